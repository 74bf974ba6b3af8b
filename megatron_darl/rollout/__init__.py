"""Rollout workers and engine backends (vLLM, HF); never imports Megatron or the trainer.

The package imports nothing itself: ``rollout.config`` is read by the run's configuration
(``loop/run_config.py``) before any process starts, and must not pull in torch or the engines.
Callers import the submodules (``rollout.worker``, ``rollout.prompts``, ``rollout.engines``).
"""
