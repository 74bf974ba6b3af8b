"""Replay buffer over the last K behavior versions and the per-version log-prob cache."""
