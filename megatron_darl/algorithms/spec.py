"""Algorithm variants as data (docs/algorithm.md, section 6): the names a run config chooses.

Every variant is the same code path with a different ``VariantSpec``: which score ranks the
buffer, which weight rule corrects for the behavior policy, which log-probs the PPO ratio is
taken against. The names of each choice (scores, mixture forms, caps, KL estimators) live here
too, with no tensor code: a run config is checked in every process, the launcher's included,
before any of them needs torch (the launcher would otherwise spend two seconds importing it
before its first child starts).

| variant        | score  | weights      | ratio base |
|----------------|--------|--------------|------------|
| sync           | fifo   | none         | proximal   |
| async          | fifo   | none         | behavior   |
| decoupled      | fifo   | own behavior | proximal   |
| darl           | chi2   | mixture      | proximal   |
| darl_nofilter  | random | mixture      | proximal   |
| darl_nomis     | chi2   | own behavior | proximal   |

The window K, the staleness bound eta and the replay cap of each preset are stated once, in
``configs/algorithm/<variant>.yaml`` (``replay.k``, ``algorithm.max_staleness``,
``replay.max_replays``); eta <= K - 1 keeps every arriving sample inside the window.

Rollout importance sampling (``with_rollout_is``, verl's "decoupled mode" with token TIS) is a
transform of a spec without behavior weights: the weight becomes the capped ratio
``pi_t / mu_{v_i}`` and the PPO ratio is taken against ``pi_t``. Keeping the ratio against
``mu`` would apply the correction twice (``rho`` already is ``pi_theta / mu``). ``needs_logprob_pass``
tells the loop whether a spec reads the trainer's log-probs at t at all (naive ``async`` does not).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class MixtureForm(str, enum.Enum):
    """Which conditional of the behavior mixture a token's weight divides by (``mis.form``)."""

    PREFIX = "prefix"  # q(y_j | y_<j) of the sequence mixture: exact (the objective)
    TOKEN = "token"  # sum_k alpha_k pi_k(y_j | y_<j): exact at the first token only (ablation)


class CapMode(str, enum.Enum):
    """How a behavior weight above its cap c is bounded (``mis.cap_mode``)."""

    CLIP = "clip"  # w = min(r, c): truncated importance sampling
    MASK = "mask"  # w = r if r <= c else 0: AReaL's decoupled-PPO cap (token dropped)


class ScoreKind(str, enum.Enum):
    """How a buffered sample is scored for selection (``selection.score``)."""

    CHI2 = "chi2"  # D-ARL: mean (r - 1)^2, variance of the token IS weight around 1
    KL = "kl"  # mean k3 estimator (r - 1) - log r of KL(mu || pi_t)
    ESS = "ess"  # 1 - ESS(r) / n: shortfall of the normalised effective sample size
    RANDOM = "random"  # uniform noise: no filter (ablation)
    FIFO = "fifo"  # -behavior version: freshest first
    OLDEST = "oldest"  # +behavior version: oldest first (arrival order, a plain async queue)


# Scores that read the token ratio pi_t / mu, i.e. need the trainer's log-prob pass at t.
RATIO_SCORES = frozenset({ScoreKind.CHI2, ScoreKind.KL, ScoreKind.ESS})


class KLEstimator(str, enum.Enum):
    """Per-token estimators of KL(pi_theta || pi_ref) (verl's names; module docstring)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class Variant(str, enum.Enum):
    """Algorithm variants, one ``configs/algorithm/<value>.yaml`` each."""

    SYNC = "sync"
    ASYNC = "async"
    DECOUPLED = "decoupled"
    DARL = "darl"
    DARL_NOFILTER = "darl_nofilter"
    DARL_NOMIS = "darl_nomis"


class WeightRule(str, enum.Enum):
    """How the behavior-policy mismatch is corrected."""

    NONE = "none"  # w = 1
    OWN_BEHAVIOR = "own_behavior"  # w = min(pi_t / mu_{v_i}, c): decoupled PPO
    MIXTURE = "mixture"  # w = min(pi_t / sum_k alpha_k pi_k, c): D-ARL MIS


class RatioBase(str, enum.Enum):
    """Which log-probs the PPO ratio rho = pi_theta / pi_base is taken against."""

    BEHAVIOR = "behavior"  # the engine's log mu_{v_i} (naive async)
    PROXIMAL = "proximal"  # the trainer's log pi_t (decoupled PPO, D-ARL)


@dataclass(frozen=True)
class VariantSpec:
    """What distinguishes one variant from another; everything else is shared code."""

    score: ScoreKind  # ranks buffered groups for selection
    weight_rule: WeightRule  # behavior correction in the loss
    ratio_base: RatioBase  # denominator of the PPO ratio


VARIANTS: dict[Variant, VariantSpec] = {
    Variant.SYNC: VariantSpec(ScoreKind.FIFO, WeightRule.NONE, RatioBase.PROXIMAL),
    Variant.ASYNC: VariantSpec(ScoreKind.FIFO, WeightRule.NONE, RatioBase.BEHAVIOR),
    Variant.DECOUPLED: VariantSpec(ScoreKind.FIFO, WeightRule.OWN_BEHAVIOR, RatioBase.PROXIMAL),
    Variant.DARL: VariantSpec(ScoreKind.CHI2, WeightRule.MIXTURE, RatioBase.PROXIMAL),
    Variant.DARL_NOFILTER: VariantSpec(ScoreKind.RANDOM, WeightRule.MIXTURE, RatioBase.PROXIMAL),
    Variant.DARL_NOMIS: VariantSpec(ScoreKind.CHI2, WeightRule.OWN_BEHAVIOR, RatioBase.PROXIMAL),
}


def needs_logprob_pass(spec: VariantSpec) -> bool:
    """Whether the variant reads log pi_t of its candidates (score, weights or ratio base).

    False for naive ``async`` (fifo score, no weights, ratio against the engine's log-probs):
    its step needs no forward pass besides the train step's own.
    """
    return (spec.score in RATIO_SCORES or spec.weight_rule is not WeightRule.NONE
            or spec.ratio_base is RatioBase.PROXIMAL)


def with_rollout_is(spec: VariantSpec) -> VariantSpec:
    """The spec with rollout importance sampling (``algorithm.rollout_is``) switched on.

    Only for specs without behavior weights (``sync``, ``async``): the weight becomes the capped
    ratio pi_t / mu_{v_i} of the trainer's log-probs against the engine's, and the PPO ratio is
    taken against pi_t (verl's decoupled mode with token-level TIS). For ``sync`` this corrects
    the engine/trainer mismatch only; for ``async`` it is the decoupled-PPO objective.
    """
    if spec.weight_rule is not WeightRule.NONE:
        raise ValueError(
            f"rollout IS applies to variants without behavior weights; this one already weights "
            f"tokens by the capped ratio pi_t / {spec.weight_rule.value} (set mis.clip instead)"
        )
    return dataclasses.replace(spec, weight_rule=WeightRule.OWN_BEHAVIOR,
                               ratio_base=RatioBase.PROXIMAL)


def variant_spec(variant: Variant | str | VariantSpec) -> VariantSpec:
    """The spec of a variant given by Enum, name, or an already-built spec."""
    if isinstance(variant, VariantSpec):
        return variant
    try:
        return VARIANTS[Variant(variant)]
    except ValueError:
        names = ", ".join(v.value for v in Variant)
        raise ValueError(
            f"unknown algorithm variant {variant!r}; expected one of: {names}"
        ) from None
