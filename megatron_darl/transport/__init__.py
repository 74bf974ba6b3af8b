"""Rendezvous, sample channel, weight broadcast and heartbeats between trainer and rollout."""
