"""Typed configs of the D-ARL step: the algorithm variant, its behavior weights, the replay window.

Hydra composes these from ``configs/algorithm/*.yaml`` (one preset per variant, each setting
``algorithm`` and ``replay``) and ``configs/config.yaml``; ``launch/`` converts the composed
config to these dataclasses once, so the step never sees a ``DictConfig``. The variant decides
the code path through ``megatron_darl.algorithms.variant_spec`` (one table, no ``if`` on names);
the fields here only tune it. Every check a user can trip raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_darl.algorithms import (
    CapMode, KLEstimator, MixtureForm, ScoreKind, Variant, VariantSpec, variant_spec, with_rollout_is,
)
from megatron_darl.replay.window import VersionWindow
from megatron_darl.step.candidates import RESCORE_MODES

BACKFILLS = ("snapshot", "nearest")  # mis.backfill: exact recompute or nearest-version copy
FILL_MAX_FACTOR = 10  # replay.fill_max_degenerate=null: 10 x B (DAPO's recipe: max_num_gen_batches=10)


@dataclass
class MisConfig:
    """Multi-behavior importance sampling (docs/algorithm.md, section 4)."""

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
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * token-mean entropy (0 = off, no entropy pass)
    kl_coef: float = 0.0  # KL to the initial policy: loss += coef * token-mean kl_estimator (0 = off)
    kl_estimator: str = "k3"  # k1 | k2 | k3 (verl's kl | mse | low_var_kl)

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
        self._check_terms()

    def _check_terms(self) -> None:
        for name in ("entropy_coef", "kl_coef"):
            value = getattr(self, name)
            if not value >= 0:  # NaN fails too
                raise ValueError(f"algorithm.{name} must be >= 0 (0 = off), got {value}")
        if self.kl_estimator not in {k.value for k in KLEstimator}:
            names = ", ".join(k.value for k in KLEstimator)
            raise ValueError(f"algorithm.kl_estimator={self.kl_estimator!r}: use one of {names}")

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


@dataclass
class ReplayConfig:
    """The replay buffer's window and eligibility (docs/algorithm.md, sections 3 and 7)."""

    k: int = 4  # window K: behavior versions [t - K + 1, t] stay buffered
    warmup: int = 0  # first steps take the freshest groups without scoring
    max_replays: Optional[int] = None  # times a group may be selected; null = while in window
    drop_degenerate: bool = True  # never select groups whose rewards are all equal
    # dynamic sampling (DAPO's filter groups, verl's algorithm.filter_groups): the hub drops a group
    # whose rewards are all equal as it arrives and gives its start back to the staleness bound, so
    # a step waits for B groups that can train; needs drop_degenerate (docs/algorithm.md, section 5)
    fill_batch: bool = False
    # fill_batch: degenerate groups one step's wait may drop before the step trains the trainable
    # ones it has (one warning line; DAPO's max_num_gen_batches); null = FILL_MAX_FACTOR x B
    fill_max_degenerate: Optional[int] = None
    rescore: str = "all"  # groups a ratio score scores at t: all (the spec) | selected, bounded (opt-in, predicted)
    rescore_audit: bool = False  # score all too and report what the rule would have selected
    prefetch: bool = True  # while the trainer waits for groups, compute rows the step will need

    def __post_init__(self) -> None:
        if self.rescore not in RESCORE_MODES:
            raise ValueError(f"replay.rescore={self.rescore!r}: use one of {RESCORE_MODES}")
        if self.k < 1:
            raise ValueError(f"replay.k must be >= 1, got {self.k}")
        if self.warmup < 0:
            raise ValueError(f"replay.warmup must be >= 0, got {self.warmup}")
        if self.max_replays is not None and self.max_replays < 1:
            raise ValueError(f"replay.max_replays must be >= 1 or null, got {self.max_replays}")
        if self.fill_batch and not self.drop_degenerate:
            raise ValueError("replay.fill_batch=true needs replay.drop_degenerate=true: it drops the groups "
                             "that selection would skip; with replay.drop_degenerate=false they are "
                             "trained, so set replay.fill_batch=false or replay.drop_degenerate=true")
        if self.fill_max_degenerate is not None and self.fill_max_degenerate < 1:
            raise ValueError(f"replay.fill_max_degenerate must be >= 1 or null, got {self.fill_max_degenerate}")

    def max_degenerate(self, groups_per_step: int) -> int | None:
        """Degenerate groups one step's wait may drop before it goes on with fewer than B trainable
        ones (``fill_max_degenerate``, default ``FILL_MAX_FACTOR`` x B); None when ``fill_batch`` is off."""
        if not self.fill_batch:
            return None
        return self.fill_max_degenerate or FILL_MAX_FACTOR * groups_per_step

    @property
    def window(self) -> VersionWindow:
        """The replay window ``[t - K + 1, t]``: buffer, cache and parameter snapshots keep it."""
        return VersionWindow(self.k)
