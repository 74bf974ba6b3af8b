"""Verifiable rewards: math answers through math-verify, code through a sandbox.

``get_reward_fn(task)`` gives the rollout worker ``reward_fn(record, response_text) -> float``
for a dataset's task (``math``, ``gsm8k``, ``humaneval``, ``stdio``, ``builtin``, ``countdown``);
``reference_check(task)`` the check that a dataset's references can be graded, which whoever loads
a dataset for a run passes to ``data.load_dataset``.
"""

from megatron_darl.rewards.code_exec import (
    CodeRewardConfig,
    extract_code,
    humaneval_reward,
    stdio_reward,
)
from megatron_darl.rewards.countdown import check_chain, countdown_reward
from megatron_darl.rewards.math_answer import MathRewardConfig, extract_answer, math_reward
from megatron_darl.rewards.registry import (
    REWARDS,
    RewardConfig,
    RewardFn,
    Task,
    get_reward_fn,
    reference_check,
    score,
)
from megatron_darl.rewards.sandbox import (
    FunctionCheck,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    run_sandboxed,
    sandbox_mode,
)

__all__ = [
    "CodeRewardConfig",
    "FunctionCheck",
    "MathRewardConfig",
    "REWARDS",
    "RewardConfig",
    "RewardFn",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailableError",
    "Task",
    "check_chain",
    "countdown_reward",
    "extract_answer",
    "extract_code",
    "get_reward_fn",
    "humaneval_reward",
    "math_reward",
    "reference_check",
    "run_sandboxed",
    "sandbox_mode",
    "score",
    "stdio_reward",
]
