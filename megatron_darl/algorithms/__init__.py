"""Pure D-ARL math (docs/algorithm.md): advantages, importance weights, losses, scores, selection.

Nothing here knows about process groups, configs or Megatron, so another RL pipeline can import
these functions into its own loss (docs/algorithm.md shows how).
"""

from megatron_darl.algorithms.advantages import grpo_advantages, rewards_equal
from megatron_darl.algorithms.importance import (
    CapMode, MixtureForm, behavior_weights, capped_tokens, mixture_log_density, prefix_mixture_log_density,
    prefix_posterior, version_alpha,
)
from megatron_darl.algorithms.loss import MAX_LOG_RATIO, PolicyLossInputs, PolicyLossStats, policy_loss
from megatron_darl.algorithms.regularizers import (
    KLEstimator, RegularizedLossInputs, RegularizerStats, kl_estimate, regularizer_loss,
)
from megatron_darl.algorithms.scores import (
    RATIO_SCORES,
    SCORES,
    ScoreKind,
    ess_score,
    fifo_score,
    oldest_score,
    group_scores,
    kl_score,
    random_score,
    score_samples,
    score_tokens,
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
    needs_logprob_pass,
    variant_spec,
    with_rollout_is,
)

__all__ = [
    "MAX_LOG_RATIO",
    "RATIO_SCORES",
    "SCORES",
    "VARIANTS",
    "BatchWeights",
    "CapMode",
    "KLEstimator",
    "MixtureForm",
    "PolicyLossInputs",
    "PolicyLossStats",
    "RegularizedLossInputs",
    "RegularizerStats",
    "RatioBase",
    "ScoreKind",
    "Variant",
    "VariantSpec",
    "WeightRule",
    "batch_behavior_weights",
    "behavior_weights",
    "capped_tokens",
    "ess_score",
    "fifo_score",
    "oldest_score",
    "grpo_advantages",
    "rewards_equal",
    "kl_estimate",
    "group_scores",
    "kl_score",
    "mixture_log_density",
    "prefix_mixture_log_density",
    "prefix_posterior",
    "needs_logprob_pass",
    "policy_loss",
    "random_score",
    "regularizer_loss",
    "score_samples",
    "score_tokens",
    "select_groups",
    "variance_score",
    "variant_spec",
    "version_alpha",
    "with_rollout_is",
]
