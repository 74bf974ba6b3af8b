"""The load-time check of a dataset's references: can the task's verifier grade them?

Whoever loads a dataset for a run (the launcher's input check, every rollout worker, eval) asks
``reference_check(task)`` and passes it to ``data.load_dataset``. It lives apart from the registry
so that asking costs nothing for tasks whose references need no check: the registry imports
every verifier, and math-verify (sympy) is imported here only for a math task.
"""

from __future__ import annotations

from typing import Callable

from megatron_darl.rewards.config import RewardConfig, Task


def reference_check(task: str, cfg: RewardConfig | None = None) -> Callable[[str], str | None] | None:
    """The load-time check of ``task``'s references (``data.load_dataset(cfg, check_reference=)``):
    why a reference cannot be graded, or None; None for tasks whose references need no check, and
    when ``cfg.fn`` names the run's own reward (its references are whatever that function reads)."""
    if (cfg is not None and cfg.fn) or task not in (Task.MATH.value, Task.GSM8K.value):
        return None
    from megatron_darl.rewards.math_answer import reference_problem  # math-verify: math tasks only

    def check(reference: str) -> str | None:
        problem = reference_problem(reference)
        return None if problem is None else f"math reference {problem}"

    return check
