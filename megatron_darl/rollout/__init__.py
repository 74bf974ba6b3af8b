"""Rollout workers and engine backends (vLLM, HF); never imports Megatron or the trainer."""
