"""The reward registry: task name -> ``reward_fn(record, response_text) -> float``.

The rollout worker and the evaluation harness look a record's ``task`` up here and never
branch on benchmarks themselves. One table keyed by the ``Task`` enum; every entry adapts a
``PromptRecord`` to the verifier's own signature. A user's own reward needs no edit here:
``reward.fn=package.module:function`` replaces the task's entry (``rewards.custom``).
"""

from __future__ import annotations

from typing import Callable

from megatron_darl.data.records import PromptRecord
from megatron_darl.rewards.builtin_answer import builtin_reward
from megatron_darl.rewards.code_exec import humaneval_reward_with, stdio_reward_with
from megatron_darl.rewards.config import RewardConfig, Task
from megatron_darl.rewards.countdown import record_reward as countdown_record_reward
from megatron_darl.rewards.custom import CustomReward
from megatron_darl.rewards.math_answer import math_reward_with
from megatron_darl.rewards.sandbox import sandbox_mode

RewardFn = Callable[[PromptRecord, str], float]


def _math(record: PromptRecord, response: str, cfg: RewardConfig) -> float:
    return math_reward_with(response, record.reference, cfg.math)


def _humaneval(record: PromptRecord, response: str, cfg: RewardConfig) -> float:
    problem = {"prompt": record.prompt, "test": record.reference,
               "entry_point": record.metadata.get("entry_point", ""),
               "task_id": record.metadata.get("source_id", record.prompt_id)}
    return humaneval_reward_with(problem, response, cfg.code)


def _stdio(record: PromptRecord, response: str, cfg: RewardConfig) -> float:
    return stdio_reward_with(response, record.tests, cfg.code)


def _builtin(record: PromptRecord, response: str, cfg: RewardConfig) -> float:
    return builtin_reward(response, record.reference)


def _countdown(record: PromptRecord, response: str, cfg: RewardConfig) -> float:
    return countdown_record_reward(record, response)


REWARDS: dict[Task, Callable[[PromptRecord, str, RewardConfig], float]] = {
    Task.MATH: _math,
    Task.GSM8K: _math,
    Task.HUMANEVAL: _humaneval,
    Task.STDIO: _stdio,
    Task.BUILTIN: _builtin,
    Task.COUNTDOWN: _countdown,
}


# Verifiers that are cheapest from worker threads. Math works from any thread too, but off the
# main thread each check is a round trip to a helper process (math_pool), so batch scorers such
# as the evaluation harness keep math in the main thread.
THREAD_SAFE_TASKS = frozenset({Task.HUMANEVAL, Task.STDIO, Task.BUILTIN, Task.COUNTDOWN})


def get_reward_fn(task: str, cfg: RewardConfig | None = None) -> RewardFn:
    """``reward_fn(record, response_text) -> float`` of ``task`` (a ``Task`` value), or the user's
    own function when ``cfg.fn`` names one (``rewards.custom``: it replaces the task's verifier).

    For code tasks this probes the sandbox once and raises ``SandboxUnavailableError`` when the
    kernel refuses its isolation (and degraded mode is not allowed), so a worker fails at start.
    """
    if cfg is not None and cfg.fn:
        return CustomReward.from_config(cfg)
    try:
        entry = REWARDS[Task(task)]
    except ValueError:
        raise ValueError(f"unknown reward task {task!r}; known: {[t.value for t in Task]}") from None
    cfg = cfg or RewardConfig()
    if Task(task) in (Task.HUMANEVAL, Task.STDIO):
        sandbox_mode(cfg.code.sandbox)  # a kernel that refuses isolation fails here, not mid-run

    def reward_fn(record: PromptRecord, response: str) -> float:
        return entry(record, response, cfg)

    return reward_fn


def score(record: PromptRecord, response: str, cfg: RewardConfig | None = None) -> float:
    """Reward of ``response`` to ``record`` under the record's own task."""
    return get_reward_fn(record.task, cfg)(record, response)
