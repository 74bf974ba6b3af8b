"""Multi-behavior importance weights (docs/algorithm.md, section 4).

A selected batch mixes samples from several behavior versions. Instead of weighting each sample
by its own behavior density (high variance when versions differ), D-ARL treats the batch as one
draw from the mixture ``q = sum_k alpha_k pi_k`` with ``alpha_k`` the token share of version k
(the balance heuristic of multiple importance sampling, Veach 1997) and weights every token by
``pi_t / q``. A response is a sequence, drawn whole from one version, so ``q`` is the mixture of
the versions' *sequence* densities, and a token's weight divides by its conditional given the
prefix (``MixtureForm.PREFIX``, ``prefix_mixture_log_density``): the mixture of the versions'
next-token probabilities under the posterior of each version given the prefix. The mixture of
per-token conditionals (``MixtureForm.TOKEN``, ``mixture_log_density``) equals it at the first
token only and is kept as an ablation.

The posterior compares versions, so it reads one source of densities for every version: given
``posterior_by_version`` (the trainer's rows of every version, the sample's own included) it
weighs the versions by those, while the conditional's terms keep ``logp_by_version`` (the
engine's row for a sample's own version: the true sampler). Engine/trainer mismatch is a KL with
a positive mean on sampled tokens; were the own version's prefix read from the engine and the
others' from the trainer, it would add up along the prefix and tip the posterior onto v_i (two
identical versions at 1e-3 nats a token: weight ~1.0 by 8k tokens instead of 1/2). The weights are capped at ``clip`` and carry no gradient,
in one of two forms (``CapMode``): truncation ``min(r, c)`` (D-ARL, verl's TIS) or AReaL's
masking, where a token whose ratio exceeds the cap gets weight 0 (it leaves the gradient; the
loss's token count keeps it).
"""

from __future__ import annotations

import math

import torch

from megatron_darl.algorithms.spec import CapMode


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


def _mixture_terms(logp_by_version: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated ``(K', ...)`` rows of the versions with ``alpha_k > 0`` and their ``(K',)`` float64
    log alpha (the other rows may hold anything: ``-inf`` for a version never cached)."""
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
    logp = logp_by_version  # no copy when every version has tokens
    if keep.numel() < a.numel():
        logp = logp_by_version.index_select(0, keep.to(logp_by_version.device))
    return logp, torch.log(a[keep]).to(logp.device)


def mixture_log_density(logp_by_version: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Mixture of per-token conditionals, ``log q = logsumexp_k(log alpha_k + logp_k)``
    (``MixtureForm.TOKEN``: the sequence mixture's conditional at a response's first token only).

    Args:
        logp_by_version: ``(K, N, T)`` (or packed ``(K, n)``) per-token log pi_k for each version k.
        alpha: ``(K,)`` non-negative mixture weights summing to 1.

    Returns:
        ``(N, T)`` (packed: ``(n,)``) log q, in the dtype of ``logp_by_version``.
    """
    logp, log_alpha = _mixture_terms(logp_by_version, alpha)
    log_alpha = log_alpha.to(logp.dtype).view(-1, *([1] * (logp.dim() - 1)))
    return torch.logsumexp(logp + log_alpha, dim=0)  # (N, T) or (n,)


def prefix_mixture_log_density(logp_by_version: torch.Tensor, alpha: torch.Tensor,
                               sample_index: torch.Tensor | None = None,
                               mask: torch.Tensor | None = None,
                               posterior_by_version: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token conditional of the sequence mixture ``q(y) = sum_k alpha_k pi_k(y)``:

        log q(y_j | y_<j) = logsumexp_k(log beta_kj + log pi_k(y_j | y_<j)),
        log beta_kj = log alpha_k + P_k,j-1 - logsumexp_k'(log alpha_k' + P_k',j-1),

    with ``P_k,j = sum_{l<=j} log pi_k(y_l)`` the prefix log-density under version k, so
    ``beta_kj`` is the posterior of version k given the prefix (``alpha`` at the first token). The
    product over j is ``q(y)``. With ``posterior_by_version`` the prefix sums P read those rows
    (one source for every version: module docstring) and the terms ``log pi_k(y_j | y_<j)``
    read ``logp_by_version``; with one version of ``alpha > 0`` the posterior is 1 and those rows
    are not read. This is the difference of the two prefix mixtures
    ``LSE_k(log alpha_k + P_kj) - LSE_k(log alpha_k + P_k,j-1)``, computed through the normalised
    posterior so that prefix sums of thousands of nats never meet in a subtraction; in float64.

    Args:
        logp_by_version: ``(K, N, T)`` rows of a padded batch (each row a response; positions
            outside ``mask`` are skipped) or packed ``(K, n)`` (responses end to end).
        alpha: ``(K,)`` non-negative mixture weights summing to 1; versions with 0 are dropped.
        sample_index: packed layout: ``(n,)`` int64 response of each token, non-decreasing.
        mask: padded layout: ``(N, T)`` response mask (default: every position).
        posterior_by_version: rows of ``logp_by_version``'s shape the posterior reads (default:
            ``logp_by_version``); versions with ``alpha_k = 0`` are dropped from both.

    Returns:
        ``(N, T)`` (packed ``(n,)``) log q(y_j | y_<j), in the dtype of ``logp_by_version``
        (padding: the value of its last real token's posterior, to be masked by the caller).
    """
    logp, log_alpha = _mixture_terms(logp_by_version, alpha)
    lp = logp.double()
    post = posterior_by_version if posterior_by_version is not None and log_alpha.numel() > 1 else logp_by_version
    if post.shape != logp_by_version.shape:
        raise ValueError(f"posterior_by_version {tuple(post.shape)} must have logp_by_version's "
                         f"shape {tuple(logp_by_version.shape)}")
    log_post = prefix_posterior(post, alpha, sample_index, mask)  # (K', ...) log beta_kj
    if lp.dim() == 3 and mask is not None:
        lp = torch.where(mask.bool(), lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
    return torch.logsumexp(log_post + lp, dim=0).to(logp.dtype)


def prefix_posterior(logp_by_version: torch.Tensor, alpha: torch.Tensor,
                     sample_index: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Log posterior of each version given the prefix before each token,
    ``log beta_kj = log alpha_k + P_k,j-1 - logsumexp_k'(log alpha_k' + P_k',j-1)``, in float64.

    Args: as ``prefix_mixture_log_density`` (the rows here are the ones the posterior reads).

    Returns:
        ``(K', N, T)`` (packed ``(K', n)``) log beta of the K' versions with ``alpha_k > 0``, in
        their order; ``alpha`` at each response's first token.
    """
    logp, log_alpha = _mixture_terms(logp_by_version, alpha)
    lp = logp.double()
    if lp.dim() == 3:  # padded rows: each row one response
        m = torch.ones(lp.shape[1:], dtype=torch.bool, device=lp.device) if mask is None else mask.bool()
        lp = torch.where(m, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
        before = torch.cumsum(lp, dim=-1) - lp  # (K', N, T) P_k,j-1
    else:
        if sample_index is None or sample_index.shape != lp.shape[1:]:
            raise ValueError(f"packed log-probs {tuple(logp.shape)} need sample_index of shape "
                             f"({lp.shape[1]},): the response of each token")
        before = _segment_exclusive_cumsum(lp, sample_index.to(lp.device))  # (K', n)
    prior = log_alpha.view(-1, *([1] * (lp.dim() - 1))) + before  # log alpha_k + P_k,j-1
    return prior - torch.logsumexp(prior, dim=0, keepdim=True)


def _segment_exclusive_cumsum(values: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """``(K, n)`` sums of the earlier values of the same segment (``segment``: ``(n,)``,
    non-decreasing): a running sum minus its value where the segment started."""
    if segment.numel() and bool((segment[1:] < segment[:-1]).any()):
        raise ValueError("sample_index must be non-decreasing (responses end to end)")
    total = torch.cumsum(values, dim=-1)  # (K, n)
    exclusive = total - values
    first = torch.ones_like(segment, dtype=torch.bool)
    first[1:] = segment[1:] != segment[:-1]  # (n,) a response's first token
    start = torch.cummax(torch.where(first, torch.arange(segment.numel(), device=segment.device),
                                     torch.zeros_like(segment)), dim=0).values  # (n,) its index
    return exclusive - exclusive[:, start]


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
