"""Configs of evaluation: benchmarks after training, held-out checkpoints, points while training.

The run config holds ``PeriodicEvalConfig`` (``eval.*``) in every process, so this module imports
only other config modules: no engine, no tokenizer, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_darl.rewards.config import RewardConfig


def check_limit(limit: float, name: str = "limit") -> None:
    """A prompt limit is -1 (all), a count N >= 1, or a fraction in (0, 1)."""
    if not (limit == -1 or 0 < limit < 1 or (limit >= 1 and float(limit).is_integer())):
        raise ValueError(f"{name}={limit}: use a prompt count N >= 1, a fraction in (0, 1), or -1 for all")


@dataclass
class BenchmarkConfig:
    """One benchmark of the evaluation table."""

    data: str  # name of the configs/data preset that maps its columns (gsm8k, math, aime, ...)
    path: str  # file, relative to the benchmark directory unless absolute


@dataclass
class EvalConfig:
    """How every benchmark is sampled and scored."""

    n: int = 16  # samples per prompt
    ks: list[int] = field(default_factory=list)  # pass@k values (each <= n); [] = powers of 2 and n
    temperature: float = 0.6  # sampling temperature
    top_p: float = 0.95  # nucleus mass
    max_new_tokens: int = 4096  # response length limit
    seed: int = 0  # base sampling seed
    batch_prompts: int = 8  # prompts per engine.generate call
    limit: float = -1  # N >= 1: the first N prompts of each benchmark; 0 < f < 1: the first fraction f; -1: all
    score_workers: int = 4  # threads for sandboxed code scoring (math stays in the main thread)
    enable_thinking: bool | None = None  # passed to chat templates that know it (Qwen3); None = default
    reward: RewardConfig = field(default_factory=RewardConfig)  # verifier settings
    progress: bool = True  # show a tqdm progress bar

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"EvalConfig.n={self.n} must be >= 1")
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"EvalConfig.ks={self.ks}: every k must be in [1, n={self.n}]")
        check_limit(self.limit, "EvalConfig.limit")


@dataclass
class HeldoutConfig:
    """How each checkpoint is scored on the held-out prompts: greedy, and optionally sampled."""

    samples: int = 0  # responses sampled per prompt at ``temperature`` besides the greedy one (0: none)
    temperature: float = 1.0  # sampling temperature of the sampled pass (the training temperature)
    max_new_tokens: int = 48  # response length limit (as in training)
    batch_prompts: int = 256  # prompts per engine call
    seed: int = 0  # sampling seed (same seed for every checkpoint)
    limit: float = -1  # N >= 1: the first N held-out prompts; 0 < f < 1: the first fraction f; -1: all
    progress: bool = True  # a bar per checkpoint: prompts done of the held-out set

    def __post_init__(self) -> None:
        if self.samples < 0 or self.max_new_tokens < 1 or self.batch_prompts < 1:
            raise ValueError("HeldoutConfig.samples must be >= 0, max_new_tokens and batch_prompts >= 1")
        if self.temperature <= 0:
            raise ValueError(f"HeldoutConfig.temperature must be > 0, got {self.temperature}")
        check_limit(self.limit, "HeldoutConfig.limit")


@dataclass
class PeriodicEvalConfig:
    """``eval.*``: held-out evaluation of the run's versions (docs/guide.md, Validation while training)."""

    benchmarks: list[str] = field(default_factory=list)  # "heldout" and/or configs/eval/benchmarks.yaml names; [] = off
    every_n_steps: int = 0  # also score version v when v % N == 0; 0 = only at start and end
    at_start: bool = True  # score version 0 (the initial policy) of a fresh run
    at_end: bool = True  # score the final version (after loop.steps steps)
    limit: float = 256  # prompts per benchmark: a count N >= 1, a fraction in (0, 1), or -1 for all
    n: int = 1  # samples per prompt (avg@n; pass@k up to n)
    temperature: float = 0.0  # 0 = greedy
    ks: list[int] = field(default_factory=list)  # pass@k values (each <= n); [] = powers of 2 and n
    max_new_tokens: int = 0  # response length limit; 0 = sampling.max_new_tokens
    batch_prompts: int = 64  # prompts per engine.generate call
    seed: int = 0  # sampling seed (the same for every version)
    worker: int = 0  # the rollout worker that evaluates (with its engine, between its generations)
    timeout_s: float = 600.0  # the trainer's longest wait for a version's result; a late one is named, skipped

    def __post_init__(self) -> None:
        if len(set(self.benchmarks)) != len(self.benchmarks):
            raise ValueError(f"eval.benchmarks={self.benchmarks}: a benchmark is named twice")
        for name, ok, rule in (("every_n_steps", self.every_n_steps >= 0, ">= 0 (0: start and end only)"),
                               ("n", self.n >= 1, ">= 1"), ("temperature", self.temperature >= 0, ">= 0 (0: greedy)"),
                               ("max_new_tokens", self.max_new_tokens >= 0, ">= 0 (0: sampling.max_new_tokens)"),
                               ("batch_prompts", self.batch_prompts >= 1, ">= 1"), ("worker", self.worker >= 0, ">= 0"),
                               ("timeout_s", self.timeout_s > 0, "> 0")):
            if not ok:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be {rule}")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"eval.n={self.n} with eval.temperature=0: greedy samples are all the same; "
                             "set eval.temperature > 0 or eval.n=1")
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"eval.ks={self.ks}: every k must be in [1, eval.n={self.n}]")
        check_limit(self.limit, "eval.limit")

    @property
    def enabled(self) -> bool:
        return bool(self.benchmarks)
