"""The D-ARL policy loss (docs/algorithm.md, section 5) and the statistics logged with it.

``L = - sum_ij m_ij w_ij min(rho_ij A_i, clip(rho_ij, 1 - eps_low, 1 + eps_high) A_i) / sum m``

with ``rho = exp(logp_new - logp_proximal)`` and ``w`` the behavior weights (detached). Setting
``w = 1`` gives PPO/GRPO against ``logp_proximal``; using the behavior log-probs as
``logp_proximal`` gives naive asynchronous PPO. The loss is the token mean over the batch; pass
``num_tokens`` to normalise by a count taken over several micro-batches or DP ranks instead.

Token layout: the tensors are either padded rows ``(N, T)`` with a mask and per-sample
advantages ``(N,)``, or the packed layout the training loop uses from the log-prob pass to the
loss: every response token of the batch end to end, ``(n,)``, with the advantage repeated per
token and no mask (every position is a real token). ``PolicyLossInputs`` carries the packed
per-token inputs as one typed record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOG_RATIO = 20.0  # |log rho| is clamped here before exp: rho in [2e-9, 5e8], never inf


@dataclass(frozen=True)
class PolicyLossInputs:
    """What ``policy_loss`` needs besides ``logp_new``, per token in the packed layout: all ``(n,)``.

    Fixed for a whole trainer step (docs/algorithm.md, PPO mini-batches); sliced alongside the
    tokens into micro-batches.
    """

    logp_base: torch.Tensor  # (n,) float32 log-probs the ratio is taken against (pi_t, or mu), detached
    weights: torch.Tensor  # (n,) float32 behavior weights w (0 on filler tokens), detached
    advantages: torch.Tensor  # (n,) float32 advantage A_i of each token's sample


@dataclass(frozen=True)
class PolicyLossStats:
    """Detached 0-dim tensors (no host sync) describing one ``policy_loss`` call."""

    clip_frac_low: torch.Tensor  # share of tokens clipped at 1 - eps_low (A < 0, rho below)
    clip_frac_high: torch.Tensor  # share of tokens clipped at 1 + eps_high (A > 0, rho above)
    weight_ess: torch.Tensor  # (sum w)^2 / (n sum w^2) in (0, 1]: normalised ESS of w
    mean_weight: torch.Tensor  # mean behavior weight over tokens
    max_weight: torch.Tensor  # largest behavior weight
    mean_ratio: torch.Tensor  # mean rho over tokens
    num_tokens: torch.Tensor  # unmasked tokens in this call

    def as_dict(self) -> dict[str, float]:
        """Plain floats for logging (one host sync)."""
        return {name: float(value) for name, value in vars(self).items()}


def _validate(
    logp_new: torch.Tensor,
    logp_proximal: torch.Tensor,
    weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
) -> None:
    shape = tuple(logp_new.shape)
    if logp_new.dim() not in (1, 2):
        raise ValueError(f"logp_new must be (N, T) or packed (n,), got shape {shape}")
    named = [("logp_proximal", logp_proximal), ("weights", weights)] + ([("mask", mask)] if mask is not None else [])
    for name, t in named:
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} must equal logp_new {shape}")
    if tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(f"advantages shape {tuple(advantages.shape)} must be ({shape[0]},) or {shape}")
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")


def policy_loss(
    logp_new: torch.Tensor,
    logp_proximal: torch.Tensor,
    weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Token-mean clipped surrogate with per-token behavior weights.

    Args:
        logp_new: ``(N, T)`` (or packed ``(n,)``) log pi_theta(y_ij), differentiable.
        logp_proximal: same shape: log-probs the ratio is taken against (pi_t, or the behavior
            log-probs for naive async); detached here.
        weights: same shape: behavior weights w_ij; detached here.
        advantages: ``(N,)`` per-sample advantages A_i, or one per token (``logp_new``'s shape).
        mask: response mask of ``logp_new``'s shape; masked positions may hold anything (even
            ``-inf``). ``None``: every position is a token (the packed layout).
        clip_low, clip_high: eps_low, eps_high of the clip range ``[1 - eps_low, 1 + eps_high]``.
        num_tokens: normaliser ``sum m``; defaults to this call's mask sum. A zero normaliser
            (no tokens) gives a loss of exactly 0 that still backpropagates (zero gradient).

    Returns:
        ``(loss, stats)``: a 0-dim float32 loss and a ``PolicyLossStats``.
    """
    _validate(logp_new, logp_proximal, weights, advantages, mask, clip_low, clip_high)
    m = mask.bool() if mask is not None else torch.ones_like(logp_new, dtype=torch.bool)  # (N, T) or (n,)
    zeros = torch.zeros_like(logp_new, dtype=torch.float32)
    log_ratio = torch.where(m, logp_new.float() - logp_proximal.detach().float(), zeros)
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # (N, T)
    adv = advantages.detach().float()
    if adv.shape != logp_new.shape:  # per sample: broadcast over the sample's tokens
        adv = adv[:, None]  # (N, 1)
    w = torch.where(m, weights.detach().float(), zeros)  # (N, T)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (N, T)
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # (N, T)
    token_loss = torch.where(m, -w * surrogate, zeros)  # (N, T)
    denom = m.sum() if num_tokens is None else torch.as_tensor(num_tokens)
    denom = denom.to(device=token_loss.device, dtype=torch.float32)
    loss = token_loss.sum() / torch.where(denom > 0, denom, torch.ones_like(denom))
    return loss, _stats(ratio.detach(), w, adv, m, clip_low, clip_high)


def _stats(
    ratio: torch.Tensor,
    w: torch.Tensor,
    adv: torch.Tensor,
    m: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> PolicyLossStats:
    """Statistics of one loss call; all finite, neutral (0 or 1) when there are no tokens."""
    with torch.no_grad():
        n = m.sum().float()  # ()
        n1 = n.clamp(min=1.0)
        low = m & (ratio < 1.0 - clip_low) & (adv < 0)  # (N, T)
        high = m & (ratio > 1.0 + clip_high) & (adv > 0)  # (N, T)
        w64 = w.double()
        w_sum, w_sq = w64.sum(), w64.square().sum()
        ess = torch.where(w_sq > 0, w_sum.square() / (n1.double() * w_sq), torch.ones_like(w_sq))
        ratio_sum = torch.where(m, ratio, torch.zeros_like(ratio)).sum()
        return PolicyLossStats(
            clip_frac_low=low.sum().float() / n1,
            clip_frac_high=high.sum().float() / n1,
            weight_ess=ess.float(),
            mean_weight=(w_sum / n1.double()).float(),
            max_weight=w.max() if w.numel() else torch.zeros((), device=w.device),
            mean_ratio=torch.where(n > 0, ratio_sum / n1, torch.ones_like(n)),
            num_tokens=n,
        )
