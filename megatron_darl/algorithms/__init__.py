"""Pure D-ARL math (docs/algorithm.md): advantages, importance weights, losses, scores, selection.

Nothing here knows about process groups, configs or Megatron, so another RL pipeline can import
these functions into its own loss (docs/algorithm.md shows how).

Names are imported on first use (PEP 562): every process checks its run config, whose choices
are named in ``spec`` (no tensor code), and the launcher must not pull in torch with them.
"""

from __future__ import annotations

from megatron_darl.lazy import lazy_exports

_HOMES = {
    "CapMode": "spec", "KLEstimator": "spec", "MixtureForm": "spec", "RATIO_SCORES": "spec",
    "RatioBase": "spec", "ScoreKind": "spec", "VARIANTS": "spec", "Variant": "spec", "VariantSpec": "spec",
    "WeightRule": "spec", "needs_logprob_pass": "spec", "variant_spec": "spec", "with_rollout_is": "spec",
    "grpo_advantages": "advantages", "rewards_equal": "advantages",
    "behavior_weights": "importance", "capped_tokens": "importance", "mixture_log_density": "importance",
    "prefix_mixture_log_density": "importance", "prefix_posterior": "importance", "version_alpha": "importance",
    "MAX_LOG_RATIO": "loss", "PolicyLossInputs": "loss", "PolicyLossStats": "loss", "policy_loss": "loss",
    "RegularizedLossInputs": "regularizers", "RegularizerStats": "regularizers", "kl_estimate": "regularizers",
    "regularizer_loss": "regularizers",
    "SCORES": "scores", "ess_score": "scores", "fifo_score": "scores", "group_scores": "scores",
    "kl_score": "scores", "oldest_score": "scores", "random_score": "scores", "score_samples": "scores",
    "score_tokens": "scores", "variance_score": "scores",
    "select_groups": "selection",
    "BatchWeights": "variants", "batch_behavior_weights": "variants",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOMES, globals())
