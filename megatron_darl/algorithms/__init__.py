"""Pure D-ARL math (DESIGN.md section 4): advantages, importance weights, losses, scores, selection.

Nothing here knows about process groups, configs or Megatron, so another RL pipeline can import
these functions into its own loss (docs/algorithm.md shows how).
"""

from megatron_darl.algorithms.advantages import grpo_advantages
from megatron_darl.algorithms.importance import behavior_weights, mixture_log_density, version_alpha
from megatron_darl.algorithms.loss import MAX_LOG_RATIO, PolicyLossStats, policy_loss
from megatron_darl.algorithms.scores import (
    SCORES,
    ScoreKind,
    ess_score,
    fifo_score,
    group_scores,
    kl_score,
    random_score,
    score_samples,
    variance_score,
)
from megatron_darl.algorithms.selection import select_groups
from megatron_darl.algorithms.variants import (
    VARIANTS,
    BatchWeights,
    RatioBase,
    Variant,
    VariantSpec,
    WeightRule,
    batch_behavior_weights,
    variant_spec,
)

__all__ = [
    "MAX_LOG_RATIO",
    "SCORES",
    "VARIANTS",
    "BatchWeights",
    "PolicyLossStats",
    "RatioBase",
    "ScoreKind",
    "Variant",
    "VariantSpec",
    "WeightRule",
    "batch_behavior_weights",
    "behavior_weights",
    "ess_score",
    "fifo_score",
    "grpo_advantages",
    "group_scores",
    "kl_score",
    "mixture_log_density",
    "policy_loss",
    "random_score",
    "score_samples",
    "select_groups",
    "variance_score",
    "variant_spec",
    "version_alpha",
]
