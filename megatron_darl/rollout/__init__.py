"""Rollout workers and engine backends (vLLM, HF); never imports Megatron or the trainer."""

from megatron_darl.rollout.prompts import PromptRecord, PromptSource
from megatron_darl.rollout.worker import EXIT_TRAINER_LOST, RolloutWorker

__all__ = ["EXIT_TRAINER_LOST", "PromptRecord", "PromptSource", "RolloutWorker"]
