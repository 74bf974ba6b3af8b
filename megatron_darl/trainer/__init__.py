"""Megatron policy trainer: parallel state, log-prob pass, train step, snapshots, checkpoints.

It takes a loss function and knows nothing about PPO; it never imports ``rollout``.
"""
