"""The reward settings of a run (``reward.*`` of the run config), apart from the verifiers.

Why a module of its own: every process of a run converts the composed config to ``RunConfig``,
and that must not import math-verify (sympy: a third of a second) or the sandbox just to know
the defaults. So the settings live here and the verifiers import them, not the other way round.

``Task`` names the reward families a dataset can ask for (``data.task``), here for the same reason:
the launcher checks the name before any verifier is needed.

``reward.fn`` names a user's own reward function (``megatron_darl.rewards.custom``); the
``math`` and ``code`` parts hold the built-in verifiers' settings, with the defaults they have
always had.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# sandbox.py is stdlib-only and loadable from its file alone, so SandboxConfig stays beside run_sandboxed
from megatron_darl.rewards.sandbox import SandboxConfig


class Task(str, Enum):
    """Reward families a dataset can name in ``DataConfig.task``."""

    MATH = "math"  # MATH-500, AIME, LightEval-style math: \boxed / patterns + math-verify
    GSM8K = "gsm8k"  # GSM8K: "#### N" or \boxed, compared with math-verify
    HUMANEVAL = "humaneval"  # function completion checked by the record's check()
    STDIO = "stdio"  # stdin/stdout programs (LiveCodeBench)
    BUILTIN = "builtin"  # the built-in arithmetic task, exact match on "answer: N"
    COUNTDOWN = "countdown"  # the built-in countdown task: a correct chain from the numbers to the target


@dataclass
class CodeRewardConfig:
    """How code answers are scored."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # limits of each run
    stdio_scoring: str = "all"  # "all": 1.0 only when every case passes; "fraction": share passed
    stdio_total_seconds: float = 30.0  # wall-clock budget of all cases of one answer together

    def __post_init__(self) -> None:
        if self.stdio_scoring not in ("all", "fraction"):
            raise ValueError(f"reward.code.stdio_scoring={self.stdio_scoring!r}: use 'all' or 'fraction'")
        if not self.stdio_total_seconds > 0:
            raise ValueError(f"reward.code.stdio_total_seconds={self.stdio_total_seconds!r}: must be > 0")


@dataclass
class MathRewardConfig:
    """How a final answer is found in a response and how long math-verify may take."""

    answer_patterns: list[str] = field(default_factory=list)  # regexes tried first; group 1 of last match
    gsm8k_marker: bool = True  # take the text after the last "#### "
    boxed: bool = True  # take the content of the last \boxed{...}
    fallback_to_math_verify: bool = True  # else let math-verify search the whole response
    timeout_seconds: int = 5  # math-verify's own parse/compare timeout (signal.alarm)
    isolation: str = "auto"  # "auto": inline in the main thread, helper process elsewhere;
    #                          "process": always a helper process; "inline": never (no timeout
    #                          off the main thread)
    hard_timeout_seconds: float = 30.0  # helper process: give up (score 0.0) after this long
    pool_workers: int = 4  # most helper processes (match the rollout worker's reward threads)

    def __post_init__(self) -> None:
        if self.isolation not in ("auto", "process", "inline"):
            raise ValueError(f"reward.math.isolation={self.isolation!r}: use auto, process or inline")
        for name in ("hard_timeout_seconds", "pool_workers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"reward.math.{name}={getattr(self, name)!r}: must be > 0")
        if self.timeout_seconds < 0:
            raise ValueError(f"reward.math.timeout_seconds={self.timeout_seconds}: must be >= 0 (0: none)")
        for i, pattern in enumerate(self.answer_patterns):
            try:
                re.compile(pattern)
            except re.error as exc:  # would otherwise fail every reward of the run
                raise ValueError(f"reward.math.answer_patterns[{i}]={pattern!r} is not a regex: {exc}") from None


@dataclass
class RewardConfig:
    """Settings of every verifier (each task uses its own part) and of a custom reward function."""

    fn: str = ""  # "package.module:function" or "path/to/file.py:function": replaces data.task's reward
    fn_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of every fn call
    fn_timeout_s: float = 60.0  # one call of fn (async ones too): scored 0.0 and counted past this
    fn_max_inflight: int = 16  # calls of fn running at once per process (hung ones included)
    math: MathRewardConfig = field(default_factory=MathRewardConfig)  # answer extraction, timeout
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)  # sandbox limits, scoring

    def __post_init__(self) -> None:
        if self.fn and ":" not in self.fn:
            raise ValueError(f"reward.fn={self.fn!r}: use package.module:function or path/to/file.py:function")
        if not self.fn_timeout_s > 0:
            raise ValueError(f"reward.fn_timeout_s={self.fn_timeout_s!r}: must be > 0")
        if self.fn_max_inflight < 1:
            raise ValueError(f"reward.fn_max_inflight={self.fn_max_inflight}: must be >= 1")
