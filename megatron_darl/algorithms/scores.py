"""Sample scores that rank buffered groups for selection (DESIGN.md section 4.4).

Lower is better: a low score means the sample's behavior distribution still matches the current
policy, so its importance weights are near 1 and its gradient estimate has low variance. The
D-ARL score is the chi-square estimate ``mean_j (r_j - 1)^2`` of the token ratio
``r = pi_t / mu``; ``kl``, ``ess``, ``random``, ``fifo`` and ``oldest`` are alternatives and ablations. All
are reached through one table keyed by ``ScoreKind``, so a variant names its score and the loop
calls ``score_samples`` without branching.

Scores are returned in float64: ``(r - 1)^2`` at a log-ratio of 50 is ~1e43, which overflows
float32 but not float64, and the ranking only needs a finite, ordered number. Masked positions
are ignored with ``torch.where`` (never multiplied), so padding may hold any value, ``-inf``
included. A sample with no unmasked token scores 0.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch


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


def _masked_log_ratio(
    logp_current: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate; return log_ratio (N,T) f64 (0 where masked), mask (N,T) bool, counts (N,) f64."""
    if logp_current.dim() != 2:
        raise ValueError(f"logp_current must be (N, T), got shape {tuple(logp_current.shape)}")
    if logp_behavior.shape != logp_current.shape or mask.shape != logp_current.shape:
        raise ValueError(
            f"logp_behavior {tuple(logp_behavior.shape)} and mask {tuple(mask.shape)} must "
            f"match logp_current {tuple(logp_current.shape)}"
        )
    m = mask.bool()  # (N, T)
    diff = logp_current.to(torch.float64) - logp_behavior.to(torch.float64)
    log_ratio = torch.where(m, diff, torch.zeros_like(diff))  # (N, T)
    n = m.sum(dim=1).to(torch.float64)  # (N,)
    return log_ratio, m, n


def _masked_mean(values: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """(N,T) values, (N,T) bool mask, (N,) counts -> (N,) mean over unmasked, 0 if none."""
    total = torch.where(m, values, torch.zeros_like(values)).sum(dim=1)  # (N,)
    return total / n.clamp(min=1.0)


def variance_score(
    logp_current: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """D-ARL score ``sum_j m_j (exp(lc_j - lb_j) - 1)^2 / sum_j m_j`` per sample.

    Args:
        logp_current: ``(N, T)`` log pi_t of each response token.
        logp_behavior: ``(N, T)`` log mu_{v_i} (the engine's log-probs).
        mask: ``(N, T)`` bool/0-1 response mask.

    Returns:
        ``(N,)`` float64 scores, >= 0; 0 for a sample with an empty mask.
    """
    log_ratio, m, n = _masked_log_ratio(logp_current, logp_behavior, mask)
    return _masked_mean(torch.expm1(log_ratio).square(), m, n)


def kl_score(
    logp_current: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean k3 estimate ``(r - 1) - log r`` of KL(mu || pi_t) per sample; ``(N,)`` float64, >= 0."""
    log_ratio, m, n = _masked_log_ratio(logp_current, logp_behavior, mask)
    return _masked_mean(torch.expm1(log_ratio) - log_ratio, m, n)


def ess_score(
    logp_current: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``1 - ESS / n``, ``ESS = (sum r)^2 / sum r^2`` over a sample's tokens; ``(N,)`` in [0, 1).

    Computed in log space (``2 logsumexp(lr) - logsumexp(2 lr)``) so it never overflows. ESS is
    invariant to rescaling r, so a sample whose tokens are all off by the same factor scores 0.
    """
    log_ratio, m, n = _masked_log_ratio(logp_current, logp_behavior, mask)
    neg_inf = torch.full_like(log_ratio, float("-inf"))
    lse1 = torch.logsumexp(torch.where(m, log_ratio, neg_inf), dim=1)  # (N,)
    lse2 = torch.logsumexp(torch.where(m, 2 * log_ratio, neg_inf), dim=1)  # (N,)
    log_ess = torch.where(n > 0, 2 * lse1 - lse2, torch.zeros_like(n))  # (N,)
    ess_fraction = torch.exp(log_ess) / n.clamp(min=1.0)
    return torch.where(n > 0, (1.0 - ess_fraction).clamp(min=0.0), torch.zeros_like(n))


def random_score(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``(n,)`` float64 uniform noise in [0, 1): selection becomes a random draw (no filter)."""
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device)


def fifo_score(behavior_version: torch.Tensor) -> torch.Tensor:
    """``-behavior_version`` as ``(N,)`` float64: the freshest samples score lowest."""
    return -behavior_version.to(torch.float64)


def oldest_score(behavior_version: torch.Tensor) -> torch.Tensor:
    """``behavior_version`` as ``(N,)`` float64: the oldest samples score lowest.

    Consuming groups in the order they were generated is what an asynchronous trainer reading a
    queue does: with the rollout ``eta`` versions ahead, every trained sample is ``eta`` stale.
    ``fifo`` (freshest first) instead skips the backlog, so a staleness bound is never reached.
    """
    return behavior_version.to(torch.float64)


# Every score takes (logp_current, logp_behavior, mask, behavior_version, generator).
ScoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Generator | None"],
    torch.Tensor,
]


def _ratio_based(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> ScoreFn:
    def score(lc, lb, mask, behavior_version, generator):  # noqa: ARG001 (uniform signature)
        return fn(lc, lb, mask)

    score.__doc__ = fn.__doc__
    return score


def _random(lc, lb, mask, behavior_version, generator):  # noqa: ARG001 (uniform signature)
    return random_score(lc.shape[0], generator, lc.device)


def _by_version(order: Callable[[torch.Tensor], torch.Tensor], name: str) -> ScoreFn:
    def score(lc, lb, mask, behavior_version, generator):  # noqa: ARG001 (uniform signature)
        if behavior_version is None:
            raise ValueError(f"behavior_version is required for the {name} score")
        if behavior_version.shape != lc.shape[:1]:
            raise ValueError(
                f"behavior_version shape {tuple(behavior_version.shape)} must be ({lc.shape[0]},)"
            )
        return order(behavior_version)

    score.__doc__ = order.__doc__
    return score


SCORES: dict[ScoreKind, ScoreFn] = {
    ScoreKind.CHI2: _ratio_based(variance_score),
    ScoreKind.KL: _ratio_based(kl_score),
    ScoreKind.ESS: _ratio_based(ess_score),
    ScoreKind.RANDOM: _random,
    ScoreKind.FIFO: _by_version(fifo_score, "fifo"),
    ScoreKind.OLDEST: _by_version(oldest_score, "oldest"),
}


def score_samples(
    kind: ScoreKind | str,
    logp_current: torch.Tensor,
    logp_behavior: torch.Tensor,
    mask: torch.Tensor,
    behavior_version: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Score each sample with the score named ``kind`` (via ``SCORES``); lower is selected first.

    Args:
        kind: a ``ScoreKind`` or its value (``"chi2"``, ``"kl"``, ``"ess"``, ``"random"``,
            ``"fifo"``, ``"oldest"``).
        logp_current, logp_behavior, mask: ``(N, T)`` as in ``variance_score``.
        behavior_version: ``(N,)`` int behavior version of each sample; required for ``fifo``
            and ``oldest``.
        generator: random source for ``random`` (reproducible ablations).

    Returns:
        ``(N,)`` float64 scores.
    """
    try:
        kind = ScoreKind(kind)
    except ValueError:
        names = ", ".join(k.value for k in ScoreKind)
        raise ValueError(f"unknown score {kind!r}; expected one of: {names}") from None
    return SCORES[kind](logp_current, logp_behavior, mask, behavior_version, generator)


def group_scores(
    sample_scores: torch.Tensor,
    num_tokens: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
) -> torch.Tensor:
    """Token-weighted mean of sample scores per group (DESIGN.md section 4.4).

    ``score_g = sum_i n_i s_i / sum_i n_i`` over the group's samples, which equals the token mean
    of the per-token score over the whole group. A group with no tokens gets the plain mean.

    Args:
        sample_scores: ``(N,)`` per-sample scores.
        num_tokens: ``(N,)`` unmasked tokens per sample.
        group_index: ``(N,)`` int64 in ``[0, num_groups)``.
        num_groups: M.

    Returns:
        ``(M,)`` float64 group scores.
    """
    if not (sample_scores.shape == num_tokens.shape == group_index.shape):
        raise ValueError(
            f"sample_scores {tuple(sample_scores.shape)}, num_tokens {tuple(num_tokens.shape)} "
            f"and group_index {tuple(group_index.shape)} must all be (N,)"
        )
    s = sample_scores.to(torch.float64)
    n = num_tokens.to(torch.float64)
    idx = group_index.long()
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=s.device)
    weighted = zeros.index_add(0, idx, s * n)  # (M,)
    tokens = zeros.index_add(0, idx, n)  # (M,)
    plain = zeros.index_add(0, idx, s) / zeros.index_add(0, idx, torch.ones_like(s)).clamp(min=1)
    return torch.where(tokens > 0, weighted / tokens.clamp(min=1e-300), plain)
