"""Typed configs of the training loop: the algorithm variant, the replay window and the run.

Hydra composes these from ``configs/algorithm/*.yaml`` (one preset per variant, each setting
``algorithm`` and ``replay``) and ``configs/config.yaml``; ``launch/`` converts the composed
config to these dataclasses once, so the loop never sees a ``DictConfig``. The variant decides
the code path through ``megatron_darl.algorithms.variant_spec`` (one table, no ``if`` on names);
the fields here only tune it. Every check a user can trip raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_darl.algorithms import (
    CapMode, MixtureForm, ScoreKind, Variant, VariantSpec, variant_spec, with_rollout_is,
)
from megatron_darl.replay.window import VersionWindow

BACKFILLS = ("snapshot", "nearest")  # mis.backfill: exact recompute or nearest-version copy
WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class MisConfig:
    """Multi-behavior importance sampling (DESIGN.md section 4.6)."""

    clip: float = 2.0  # cap c of the behavior weights w = min(pi_t / q, c)
    backfill: str = "snapshot"  # "snapshot" (exact, from kept parameter snapshots) or "nearest"
    cap_mode: str = "clip"  # "clip": w = min(r, c); "mask": w = 0 where r > c (AReaL)
    form: str = "prefix"  # the mixture's conditional: "prefix" (sequence mixture, exact) or "token" (ablation)


@dataclass
class AlgorithmConfig:
    """Which variant runs and its PPO/GRPO knobs (``configs/algorithm/<variant>.yaml``)."""

    variant: str = "darl"  # one of megatron_darl.algorithms.Variant
    groups_per_step: int = 8  # B: prompt groups per optimizer step (all DP shards together)
    group_size: int = 8  # G: responses per prompt
    max_staleness: int = 2  # eta: groups_started <= (t + eta + 1) * B (0 = synchronous)
    eps_low: float = 0.2  # lower PPO clip: rho >= 1 - eps_low
    eps_high: float = 0.2  # upper PPO clip: rho <= 1 + eps_high
    ppo_minibatches: int = 1  # M: optimizer steps per trainer step, over 1/M of the batch each
    ppo_epochs: int = 1  # passes over the M mini-batches (M x epochs optimizer steps per version)
    rollout_is: Optional[float] = None  # cap of the token IS weight pi_t / mu (sync/async); null = off
    score: str = ""  # selection.score override (chi2|kl|ess|random|fifo); "" = the variant's
    mis: MisConfig = field(default_factory=MisConfig)  # behavior weights and backfill
    adv_eps: float = 1e-6  # eps added to the group reward std of GRPO advantages
    seed: int = 0  # seed of the random score (darl_nofilter), per step and shard

    def __post_init__(self) -> None:
        variant_spec(self.variant)  # raises ValueError naming the choices
        if self.score:
            try:
                ScoreKind(self.score)
            except ValueError:
                names = ", ".join(k.value for k in ScoreKind)
                raise ValueError(f"algorithm.score={self.score!r}: use one of {names} or ''") from None
        for name in ("groups_per_step", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"algorithm.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"algorithm.max_staleness must be >= 0, got {self.max_staleness}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"algorithm.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"algorithm.eps_high must be >= 0, got {self.eps_high}")
        for name in ("ppo_minibatches", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"algorithm.{name} must be >= 1, got {getattr(self, name)}")
        self._check_weights()

    def _check_weights(self) -> None:
        if not self.mis.clip > 0:
            raise ValueError(f"algorithm.mis.clip must be > 0, got {self.mis.clip}")
        if self.mis.backfill not in BACKFILLS:
            raise ValueError(f"algorithm.mis.backfill={self.mis.backfill!r}: use one of {BACKFILLS}")
        if self.mis.cap_mode not in {m.value for m in CapMode}:
            raise ValueError(f"algorithm.mis.cap_mode={self.mis.cap_mode!r}: use clip or mask")
        if self.mis.form not in {f.value for f in MixtureForm}:
            raise ValueError(f"algorithm.mis.form={self.mis.form!r}: use prefix or token")
        if self.rollout_is is not None:
            if not self.rollout_is > 0:
                raise ValueError(f"algorithm.rollout_is must be > 0 or null, got {self.rollout_is}")
            try:
                with_rollout_is(variant_spec(self.variant))
            except ValueError as exc:
                raise ValueError(f"algorithm.rollout_is with variant {self.variant!r}: {exc}") from None

    def spec(self) -> VariantSpec:
        """The variant's spec with this config's score override and rollout IS applied."""
        spec = variant_spec(Variant(self.variant))
        if self.score:
            spec = dataclasses.replace(spec, score=ScoreKind(self.score))
        return with_rollout_is(spec) if self.rollout_is is not None else spec

    @property
    def weight_cap(self) -> float:
        """Cap of the behavior weights: ``rollout_is`` when on, else ``mis.clip``."""
        return self.rollout_is if self.rollout_is is not None else self.mis.clip

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per trainer step (one published version)."""
        return self.ppo_minibatches * self.ppo_epochs


def density_temperature(temperature: float, top_p: float, top_k: int) -> float:
    """The temperature the trainer's log-probs must use to match the sampler's density.

    The engines report log-probs of the processed distribution they sample from (logits / T,
    then top-k/top-p truncation). The trainer applies the temperature; truncation it does not
    reproduce, so a truncated sampler is refused here, naming the fields. Greedy decoding
    (T = 0) reports temperature-1 log-probs, so the trainer uses 1.
    """
    if top_p < 1.0 or top_k > 0:
        raise ValueError(
            f"sampling.top_p={top_p} / sampling.top_k={top_k}: truncated sampling is not supported "
            "for training (the trainer's log-probs would be of the untruncated distribution, the "
            "engine's of the truncated one); use top_p 1.0 and top_k -1"
        )
    if temperature < 0:
        raise ValueError(f"sampling.temperature must be >= 0, got {temperature}")
    return temperature if temperature > 0 else 1.0


@dataclass
class ReplayConfig:
    """The replay buffer's window and eligibility (DESIGN.md section 4.2 and 4.5)."""

    k: int = 4  # window K: behavior versions [t - K + 1, t] stay buffered
    warmup: int = 0  # first steps take the freshest groups without scoring
    max_replays: Optional[int] = None  # times a group may be selected; null = while in window
    drop_degenerate: bool = True  # never select groups whose rewards are all equal

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"replay.k must be >= 1, got {self.k}")
        if self.warmup < 0:
            raise ValueError(f"replay.warmup must be >= 0, got {self.warmup}")
        if self.max_replays is not None and self.max_replays < 1:
            raise ValueError(f"replay.max_replays must be >= 1 or null, got {self.max_replays}")

    @property
    def window(self) -> VersionWindow:
        """The replay window ``[t - K + 1, t]``: buffer, cache and parameter snapshots keep it."""
        return VersionWindow(self.k)


@dataclass
class WandbConfig:
    """Weights & Biases logging; ``offline`` writes under the run dir without any network."""

    mode: str = "disabled"  # "disabled", "offline" or "online"
    project: str = "megatron_darl"  # W&B project
    entity: str = ""  # W&B entity (team); "" = the default
    name: str = ""  # run name; "" = the run dir's name

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"loop.wandb.mode={self.mode!r}: use one of {WANDB_MODES}")


@dataclass
class LoopConfig:
    """How long the run goes, where it writes, and how often it logs and checkpoints."""

    steps: int = 100  # optimizer steps to run
    run_dir: str = "runs/default"  # metrics.jsonl, tensorboard/, plot, summary, checkpoints
    log_interval: int = 1  # steps between console log lines (metrics are written every step)
    # steps between checkpoints; null = by time (checkpoint_overhead); 0 = only at the end and on SIGTERM
    checkpoint_interval: Optional[int] = None
    checkpoint_overhead: float = 0.015  # null interval: periodic saves' share of wall time (~67x a save apart)
    keep_checkpoints: int = 2  # newest complete checkpoints kept once a new one is; 0 = keep all
    resume: bool = False  # continue from the latest checkpoint in run_dir when there is one
    receive_timeout_s: float = 600.0  # longest wait for a step's groups before naming the workers
    progress_bar: bool = True  # live tqdm bar (step, reward, staleness, tokens/s)
    tensorboard: bool = True  # write <run_dir>/tensorboard
    plot: bool = True  # write <run_dir>/progress.png at the end
    wandb: WandbConfig = field(default_factory=WandbConfig)  # W&B (off by default)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form tags copied to summary.json

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"loop.steps must be >= 0, got {self.steps}")
        if self.log_interval < 1:
            raise ValueError(f"loop.log_interval must be >= 1, got {self.log_interval}")
        if self.checkpoint_interval is not None and self.checkpoint_interval < 0:
            raise ValueError(f"loop.checkpoint_interval must be >= 0 or null, got {self.checkpoint_interval}")
        if not 0 <= self.checkpoint_overhead < 1:
            raise ValueError(f"loop.checkpoint_overhead must be in [0, 1), got {self.checkpoint_overhead}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"loop.keep_checkpoints must be >= 0 (0 keeps all), got {self.keep_checkpoints}")
        if self.receive_timeout_s <= 0:
            raise ValueError(f"loop.receive_timeout_s must be > 0, got {self.receive_timeout_s}")
        if not self.run_dir:
            raise ValueError("loop.run_dir must not be empty")


@dataclass
class ModelConfig:
    """Where the initial policy comes from (``configs/model/*.yaml`` give ``name`` + ``hf_config``).

    Resolution, in order: ``path`` (an HF checkpoint directory: weights, config, tokenizer);
    else ``hf_config`` (random init at that shape, benchmarks); else the embedded default, the
    warm-started tiny policy of ``megatron_darl.loop.warmstart`` (built and cached on first use).
    """

    name: str = "tiny"  # label for logs and result tables
    path: str = ""  # HF checkpoint directory; "" = see above
    hf_config: dict[str, Any] = field(default_factory=dict)  # HF config.json fields (random init)

    @property
    def needs_warm_start(self) -> bool:
        return not self.path and not self.hf_config
