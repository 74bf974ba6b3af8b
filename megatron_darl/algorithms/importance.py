"""Multi-behavior importance weights (DESIGN.md section 4.6).

A selected batch mixes samples from several behavior versions. Instead of weighting each sample
by its own behavior density (high variance when versions differ), D-ARL treats the batch as one
draw from the mixture ``q = sum_k alpha_k pi_k`` with ``alpha_k`` the token share of version k
(the balance heuristic of multiple importance sampling, Veach 1997) and weights every token by
``pi_t / q``. The weights are capped at ``clip`` and carry no gradient, in one of two forms
(``CapMode``): truncation ``min(r, c)`` (D-ARL, verl's TIS) or AReaL's masking, where a token whose
ratio exceeds the cap gets weight 0 (it leaves the gradient; the loss's token count keeps it).
"""

from __future__ import annotations

import enum
import math

import torch


class CapMode(str, enum.Enum):
    """How a behavior weight above its cap c is bounded (``mis.cap_mode``)."""

    CLIP = "clip"  # w = min(r, c): truncated importance sampling
    MASK = "mask"  # w = r if r <= c else 0: AReaL's decoupled-PPO cap (token dropped)


def version_alpha(version_tokens: torch.Tensor) -> torch.Tensor:
    """Mixture weights ``alpha_k = tokens_k / sum_k tokens_k`` from ``(K,)`` token counts.

    Returns ``(K,)`` float64 summing to 1. Raises ``ValueError`` if the counts are negative or
    all zero.
    """
    if version_tokens.dim() != 1:
        raise ValueError(f"version_tokens must be (K,), got shape {tuple(version_tokens.shape)}")
    counts = version_tokens.to(torch.float64)
    if bool((counts < 0).any()):
        raise ValueError(f"version_tokens must be >= 0, got {version_tokens.tolist()}")
    total = counts.sum()
    if float(total) <= 0:
        raise ValueError("version_tokens must not be all zero (empty batch)")
    return counts / total


def mixture_log_density(logp_by_version: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Log density of the behavior mixture: ``log q = logsumexp_k(log alpha_k + logp_k)``.

    Versions with ``alpha_k == 0`` are dropped before the reduction, so their rows may hold
    anything (``-inf`` for a version that was never cached, for instance).

    Args:
        logp_by_version: ``(K, N, T)`` (or packed ``(K, n)``) per-token log pi_k for each version k.
        alpha: ``(K,)`` non-negative mixture weights summing to 1.

    Returns:
        ``(N, T)`` (packed: ``(n,)``) log q, in the dtype of ``logp_by_version``.
    """
    if logp_by_version.dim() not in (2, 3):
        raise ValueError(
            f"logp_by_version must be (K, N, T) or packed (K, n), got shape {tuple(logp_by_version.shape)}"
        )
    if alpha.shape != logp_by_version.shape[:1]:
        raise ValueError(
            f"alpha shape {tuple(alpha.shape)} must be ({logp_by_version.shape[0]},)"
        )
    a = alpha.detach().to(torch.float64)
    if bool((a < 0).any()) or not math.isclose(float(a.sum()), 1.0, abs_tol=1e-4):
        raise ValueError(f"alpha must be non-negative and sum to 1, got {alpha.tolist()}")
    keep = torch.nonzero(a > 0).flatten()  # (K',)
    logp = logp_by_version  # (K', N, T) after dropping alpha-0 versions (no copy if none)
    if keep.numel() < a.numel():
        logp = logp_by_version.index_select(0, keep.to(logp_by_version.device))
    log_alpha = torch.log(a[keep]).to(logp.dtype).to(logp.device)  # (K',)
    log_alpha = log_alpha.view(-1, *([1] * (logp.dim() - 1)))
    return torch.logsumexp(logp + log_alpha, dim=0)  # (N, T) or (n,)


def behavior_weights(
    logp_current: torch.Tensor,
    log_q: torch.Tensor,
    clip: float | None,
    mask: torch.Tensor | None = None,
    cap_mode: CapMode | str = CapMode.CLIP,
) -> torch.Tensor:
    """Capped importance weights ``w = min(exp(logp_current - log_q), clip)``, no gradient.

    The exponent is clamped at ``log(clip)`` before ``exp`` so large log-ratios never overflow.
    With ``cap_mode="mask"`` a token whose ratio exceeds ``clip`` gets weight 0 instead of
    ``clip`` (AReaL); ``capped_tokens`` tells which tokens the cap touched.

    Args:
        logp_current: ``(N, T)`` log pi_t (the proximal policy, the weights published as t).
        log_q: ``(N, T)`` log behavior density (the mixture, or the sample's own behavior).
        clip: truncation c > 0; ``None`` or ``inf`` for no truncation.
        mask: optional ``(N, T)`` response mask; masked positions get weight 0 whatever their
            log-probs hold.
        cap_mode: ``"clip"`` (truncate at ``clip``) or ``"mask"`` (weight 0 above ``clip``).

    Returns:
        ``(N, T)`` float32 weights, detached.
    """
    if log_q.shape != logp_current.shape:
        raise ValueError(
            f"log_q shape {tuple(log_q.shape)} must equal logp_current {tuple(logp_current.shape)}"
        )
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    cap_mode = _cap_mode(cap_mode)
    with torch.no_grad():
        log_ratio = logp_current.detach().float() - log_q.detach().float()  # (N, T)
        cap = math.log(clip) if clip is not None and math.isfinite(clip) else 80.0
        weights = torch.exp(log_ratio.clamp(max=cap))  # (N, T)
        if clip is not None:
            weights = weights.clamp(max=clip)
            if cap_mode is CapMode.MASK:
                over = _over_cap(log_ratio, clip)  # (N, T)
                weights = torch.where(over, torch.zeros_like(weights), weights)
        if mask is not None:
            if mask.shape != logp_current.shape:
                raise ValueError(
                    f"mask shape {tuple(mask.shape)} must equal logp_current "
                    f"{tuple(logp_current.shape)}"
                )
            weights = torch.where(mask.bool(), weights, torch.zeros_like(weights))
    return weights


def _cap_mode(cap_mode: CapMode | str) -> CapMode:
    try:
        return CapMode(cap_mode)
    except ValueError:
        raise ValueError(f"cap_mode must be one of {[m.value for m in CapMode]}, got {cap_mode!r}") from None


def _over_cap(log_ratio: torch.Tensor, clip: float) -> torch.Tensor:
    """True where ``exp(log_ratio) > clip`` (compared in log space: no overflow)."""
    return log_ratio > math.log(clip) if math.isfinite(clip) else torch.zeros_like(log_ratio, dtype=torch.bool)


def capped_tokens(
    logp_current: torch.Tensor, log_q: torch.Tensor, clip: float | None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``(N, T)`` bool: tokens whose ratio ``pi_t / q`` exceeds ``clip`` (truncated or masked)."""
    if clip is None:
        return torch.zeros(logp_current.shape, dtype=torch.bool, device=logp_current.device)
    with torch.no_grad():
        over = _over_cap(logp_current.detach().float() - log_q.detach().float(), clip)
    return over & mask.bool() if mask is not None else over
