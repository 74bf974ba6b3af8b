"""Benchmark evaluation: avg@n and unbiased pass@k over the rollout engine backends.

Nothing is imported here: ``megatron_darl.eval.config`` is read by ``RunConfig`` at every launch,
and the harness pulls in math-verify, sympy and torch. Import from the modules:
``benchmarks`` (files and tables), ``harness`` (``evaluate_benchmark``), ``metrics`` (pass@k),
``heldout`` (scoring checkpoints on a task's test split).
"""
