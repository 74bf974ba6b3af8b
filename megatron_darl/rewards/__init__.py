"""Verifiable rewards: math answers through math-verify, code through a sandbox, user functions.

``get_reward_fn(task, cfg)`` gives the rollout worker ``reward_fn(record, response_text) -> float``
for a dataset's task (``math``, ``gsm8k``, ``humaneval``, ``stdio``, ``builtin``, ``countdown``),
or the user's own function when ``reward.fn`` names one (``custom``); ``reference_check(task)``
the check that a dataset's references can be graded, which whoever loads a dataset for a run
passes to ``data.load_dataset``.

Names are imported on first use (PEP 562): the run config imports ``rewards.config`` in every
process, and that must not pull in math-verify (sympy) or the sandbox with it.
"""

from __future__ import annotations

from megatron_darl.lazy import lazy_exports

_HOMES = {
    "CodeRewardConfig": "config", "extract_code": "code_exec", "humaneval_reward": "code_exec",
    "stdio_reward": "code_exec",
    "check_chain": "countdown", "countdown_reward": "countdown",
    "MathRewardConfig": "config", "RewardConfig": "config",
    "extract_answer": "math_answer", "math_reward": "math_answer",
    "REWARDS": "registry", "RewardFn": "registry", "Task": "config", "get_reward_fn": "registry",
    "reference_check": "references", "score": "registry",
    "CustomReward": "custom", "check_reward": "custom", "load_reward_fn": "custom",
    "FunctionCheck": "sandbox", "SandboxConfig": "sandbox", "SandboxResult": "sandbox",
    "SandboxUnavailableError": "sandbox", "run_sandboxed": "sandbox", "sandbox_mode": "sandbox",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOMES, globals())
