"""Rollout workers and engine backends (vLLM, HF); never imports Megatron or the trainer."""

from megatron_darl.rollout.prompts import PromptRecord, PromptSource
from megatron_darl.rollout.worker import RolloutWorker

__all__ = ["PromptRecord", "PromptSource", "RolloutWorker"]
