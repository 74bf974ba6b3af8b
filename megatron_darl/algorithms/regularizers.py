"""The optional terms added to the policy loss: an entropy bonus and a KL penalty to a reference.

Both are off by default (docs/algorithm.md, section 5); they enter the loss per token, as verl's
actor adds them, and share the policy loss's token mean:

``L_total = L_policy - entropy_coef * mean_ij H_ij + kl_coef * mean_ij kl(log pi_theta(y_ij), log pi_ref(y_ij))``

``H_ij`` is the entropy of the sampled distribution (``softmax(logits / T)``) over the whole
vocabulary at token j of sample i, differentiable (``trainer.logprobs``); ``pi_ref`` is the initial
policy (version 0), its log-probs fixed. ``kl`` is one of Schulman's estimators of
KL(pi_theta || pi_ref) from the sampled tokens, named as verl names them (``kl_loss_type``):

    k1  log pi_theta - log pi_ref                         unbiased, can be negative
    k2  (log pi_theta - log pi_ref)^2 / 2                 verl's "mse"; its gradient is KL's
    k3  r - log r - 1,  r = pi_ref / pi_theta             verl's "low_var_kl": >= 0, low variance

k3 clamps ``log r`` to [-20, 20] and the result to [-10, 10] exactly as verl does, so a coefficient
tuned there means the same here. The gradient flows through ``log pi_theta`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_darl.algorithms.loss import PolicyLossInputs
from megatron_darl.algorithms.spec import KLEstimator

K3_LOG_RATIO_CLAMP = 20.0  # |log pi_ref - log pi_theta| clamped before exp (verl)
K3_VALUE_CLAMP = 10.0  # k3 clamped to [-10, 10] (verl)


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: KLEstimator | str) -> torch.Tensor:
    """Per-token KL estimate, differentiable in ``logp`` (``logp_ref`` is detached).

    Args:
        logp: (n,) log pi_theta of the sampled tokens.
        logp_ref: (n,) log pi_ref of the same tokens.
        estimator: ``k1``, ``k2`` or ``k3``.

    Returns:
        (n,) float32 (float64 for float64 ``logp``).
    """
    kind = KLEstimator(estimator)
    diff = logp - logp_ref.detach().to(logp.dtype)  # log pi_theta - log pi_ref
    if kind is KLEstimator.K1:
        return diff
    if kind is KLEstimator.K2:
        return 0.5 * diff.square()
    log_r = (-diff).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # log pi_ref - log pi_theta
    return (torch.exp(log_r) - log_r - 1).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


@dataclass(frozen=True)
class RegularizedLossInputs(PolicyLossInputs):
    """``PolicyLossInputs`` plus what the optional terms read, per token in the packed layout: ``(n,)``.

    Used only when a term is on, so the default step carries and sends nothing more.
    """

    token_mask: torch.Tensor  # (n,) float32 1 on a trained sample's tokens, 0 on a zero-weight stand-in
    logp_ref: torch.Tensor  # (n,) float32 log pi_ref (the initial policy); zeros when the KL term is off


@dataclass(frozen=True)
class RegularizerStats:
    """Detached 0-dim tensors describing one ``regularizer_loss`` call."""

    entropy: torch.Tensor  # mean entropy over the tokens (0 when not computed)
    kl: torch.Tensor  # mean KL estimate over the tokens (0 when the term is off)


def regularizer_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    logp_ref: torch.Tensor | None,
    mask: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    estimator: KLEstimator | str = KLEstimator.K3,
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, RegularizerStats]:
    """``kl_coef * sum m kl - entropy_coef * sum m H``, over ``num_tokens`` (the policy loss's
    normaliser: ``num_tokens=1`` gives the sum the trainer divides by the step's tokens).

    Args:
        logp: (n,) log pi_theta of the sampled tokens, differentiable.
        entropy: (n,) entropy of the sampled distribution at each token, differentiable; may be
            None when ``entropy_coef`` is 0.
        logp_ref: (n,) reference log-probs; may be None when ``kl_coef`` is 0.
        mask: (n,) tokens that count (1) or not (0); None: all.
        entropy_coef, kl_coef: the terms' coefficients (>= 0; 0 leaves the term out entirely).
        estimator: the KL estimator.
        num_tokens: normaliser; defaults to the mask's sum (a zero normaliser gives 0).

    Returns:
        ``(loss, stats)``: a 0-dim float32 loss and the terms' token means.
    """
    if entropy_coef < 0 or kl_coef < 0:
        raise ValueError(f"entropy_coef and kl_coef must be >= 0, got {entropy_coef}, {kl_coef}")
    if entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    if kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs the reference log-probs")
    m = torch.ones_like(logp, dtype=torch.float32) if mask is None else mask.detach().float()  # (n,)
    count = m.sum()
    denom = count if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    loss = torch.zeros((), dtype=torch.float32, device=logp.device)
    zero = torch.zeros((), device=logp.device)
    ent_mean = kl_mean = zero
    if entropy is not None:
        ent_sum = (m * entropy.float()).sum()
        ent_mean = ent_sum.detach() / count.clamp(min=1.0)
        if entropy_coef > 0:
            loss = loss - entropy_coef * ent_sum / denom
    if kl_coef > 0:
        kl_sum = (m * kl_estimate(logp.float(), logp_ref.float(), estimator)).sum()
        kl_mean = kl_sum.detach() / count.clamp(min=1.0)
        loss = loss + kl_coef * kl_sum / denom
    return loss, RegularizerStats(entropy=ent_mean, kl=kl_mean)
