"""Sample scores that rank buffered groups for selection (docs/algorithm.md, section 2).

Lower is better: a low score means the sample's behavior distribution still matches the current
policy, so its importance weights are near 1 and its gradient estimate has low variance. The
D-ARL score is the chi-square estimate ``mean_j (r_j - 1)^2`` of the token ratio
``r = pi_t / mu``; ``kl``, ``ess``, ``random``, ``fifo`` and ``oldest`` are alternatives and ablations. All
are reached through one table keyed by ``ScoreKind``, so a variant names its score and the loop
calls ``score_samples`` without branching.

Scores are returned in float64: ``(r - 1)^2`` at a log-ratio of 50 is ~1e43, which overflows
float32 but not float64, and the ranking only needs a finite, ordered number. Masked positions
are ignored with ``torch.where`` (never multiplied), so padding may hold any value, ``-inf``
included. A sample with no unmasked token scores 0. Every score is computed on the packed
layout (the unmasked tokens of all samples end to end, ``score_tokens``); ``score_samples`` takes
padded ``(N, T)`` rows and packs them first.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_darl.algorithms.spec import ScoreKind


def _flatten(
    logp_current: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(N, T) rows -> the packed layout: log_ratio (n,) f64 of the unmasked tokens, row (n,)."""
    if logp_current.dim() != 2:
        raise ValueError(f"logp_current must be (N, T), got shape {tuple(logp_current.shape)}")
    if logp_behavior.shape != logp_current.shape or mask.shape != logp_current.shape:
        raise ValueError(
            f"logp_behavior {tuple(logp_behavior.shape)} and mask {tuple(mask.shape)} must "
            f"match logp_current {tuple(logp_current.shape)}"
        )
    m = mask.bool()  # (N, T)
    rows = torch.arange(m.shape[0], device=m.device)[:, None].expand(m.shape)[m]  # (n,)
    diff = logp_current[m].to(torch.float64) - logp_behavior[m].to(torch.float64)  # (n,)
    return diff, rows, int(m.shape[0])


def _per_sample_mean(values: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    """(n,) token values -> (N,) mean over each sample's tokens, 0 for a sample without any."""
    zeros = torch.zeros(num_samples, dtype=torch.float64, device=values.device)
    total = zeros.index_add(0, sample_index, values)  # (N,)
    count = zeros.index_add(0, sample_index, torch.ones_like(values))  # (N,)
    return total / count.clamp(min=1.0)


def _chi2(log_ratio: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    return _per_sample_mean(torch.expm1(log_ratio).square(), sample_index, num_samples)


def _k3(log_ratio: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    return _per_sample_mean(torch.expm1(log_ratio) - log_ratio, sample_index, num_samples)


def _segment_logsumexp(x: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    """(n,) -> (N,) logsumexp over each sample's tokens; -inf for a sample without any."""
    peak = torch.full((num_samples,), float("-inf"), dtype=x.dtype, device=x.device)
    peak = peak.scatter_reduce(0, sample_index, x, "amax")  # (N,)
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.zeros_like(peak).index_add(0, sample_index, torch.exp(x - safe[sample_index]))
    return safe + torch.log(total)


def _ess(log_ratio: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    n = torch.zeros(num_samples, dtype=torch.float64, device=log_ratio.device).index_add(
        0, sample_index, torch.ones_like(log_ratio))  # (N,)
    lse1 = _segment_logsumexp(log_ratio, sample_index, num_samples)  # (N,)
    lse2 = _segment_logsumexp(2 * log_ratio, sample_index, num_samples)  # (N,)
    log_ess = torch.where(n > 0, 2 * lse1 - lse2, torch.zeros_like(n))
    ess_fraction = torch.exp(log_ess) / n.clamp(min=1.0)
    return torch.where(n > 0, (1.0 - ess_fraction).clamp(min=0.0), torch.zeros_like(n))


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
    return _chi2(*_flatten(logp_current, logp_behavior, mask))


def kl_score(
    logp_current: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean k3 estimate ``(r - 1) - log r`` of KL(mu || pi_t) per sample; ``(N,)`` float64, >= 0."""
    return _k3(*_flatten(logp_current, logp_behavior, mask))


def ess_score(
    logp_current: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``1 - ESS / n``, ``ESS = (sum r)^2 / sum r^2`` over a sample's tokens; ``(N,)`` in [0, 1).

    Computed in log space (``2 logsumexp(lr) - logsumexp(2 lr)``) so it never overflows. ESS is
    invariant to rescaling r, so a sample whose tokens are all off by the same factor scores 0.
    """
    return _ess(*_flatten(logp_current, logp_behavior, mask))


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


# Every score takes the packed layout: (log_ratio (n,) f64, sample_index (n,), num_samples,
# behavior_version (N,) or None, generator) and returns (N,) float64.
ScoreFn = Callable[
    [torch.Tensor, torch.Tensor, int, "torch.Tensor | None", "torch.Generator | None"], torch.Tensor,
]


def _ratio_based(fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> ScoreFn:
    def score(log_ratio, sample_index, num_samples, behavior_version, generator):  # noqa: ARG001
        return fn(log_ratio, sample_index, num_samples)

    return score


def _random(log_ratio, sample_index, num_samples, behavior_version, generator):  # noqa: ARG001
    return random_score(num_samples, generator, log_ratio.device)


def _by_version(order: Callable[[torch.Tensor], torch.Tensor], name: str) -> ScoreFn:
    def score(log_ratio, sample_index, num_samples, behavior_version, generator):  # noqa: ARG001
        if behavior_version is None:
            raise ValueError(f"behavior_version is required for the {name} score")
        if behavior_version.shape != (num_samples,):
            raise ValueError(
                f"behavior_version shape {tuple(behavior_version.shape)} must be ({num_samples},)"
            )
        return order(behavior_version)

    score.__doc__ = order.__doc__
    return score


SCORES: dict[ScoreKind, ScoreFn] = {
    ScoreKind.CHI2: _ratio_based(_chi2),
    ScoreKind.KL: _ratio_based(_k3),
    ScoreKind.ESS: _ratio_based(_ess),
    ScoreKind.RANDOM: _random,
    ScoreKind.FIFO: _by_version(fifo_score, "fifo"),
    ScoreKind.OLDEST: _by_version(oldest_score, "oldest"),
}


def _kind(kind: ScoreKind | str) -> ScoreKind:
    try:
        return ScoreKind(kind)
    except ValueError:
        names = ", ".join(k.value for k in ScoreKind)
        raise ValueError(f"unknown score {kind!r}; expected one of: {names}") from None


def score_samples(
    kind: ScoreKind | str,
    logp_current: torch.Tensor,
    logp_behavior: torch.Tensor,
    mask: torch.Tensor,
    behavior_version: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Score each sample of padded ``(N, T)`` rows with the score ``kind``; lower is selected first.

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
    kind = _kind(kind)
    return SCORES[kind](*_flatten(logp_current, logp_behavior, mask), behavior_version, generator)


def score_tokens(
    kind: ScoreKind | str,
    logp_current: torch.Tensor,
    logp_behavior: torch.Tensor,
    sample_index: torch.Tensor,
    num_samples: int,
    behavior_version: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``score_samples`` for the packed layout: the response tokens of N samples end to end.

    Args:
        logp_current, logp_behavior: ``(n,)`` log pi_t and log mu of every token.
        sample_index: ``(n,)`` int64 sample (in ``[0, num_samples)``) each token belongs to.
        num_samples: N; a sample without tokens scores 0 (``random``: a draw; ``fifo``: its version).

    Returns:
        ``(N,)`` float64 scores, equal to ``score_samples`` on the same samples padded.
    """
    kind = _kind(kind)
    if logp_current.dim() != 1 or logp_behavior.shape != logp_current.shape \
            or sample_index.shape != logp_current.shape:
        raise ValueError(f"logp_current {tuple(logp_current.shape)}, logp_behavior "
                         f"{tuple(logp_behavior.shape)} and sample_index {tuple(sample_index.shape)} "
                         "must all be (n,)")
    log_ratio = logp_current.to(torch.float64) - logp_behavior.to(torch.float64)
    return SCORES[kind](log_ratio, sample_index.long(), num_samples, behavior_version, generator)


def group_scores(
    sample_scores: torch.Tensor,
    num_tokens: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
) -> torch.Tensor:
    """Token-weighted mean of sample scores per group (docs/algorithm.md, section 2).

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
