"""Variance-guided selection of buffered groups (docs/algorithm.md, section 3).

Among eligible groups, take the ``quota`` with the lowest score; equal scores go to the fresher
group. The function sees one shard's candidates; the buffer calls it once per DP shard with that
shard's quota, so selection never moves sample data between shards.
"""

from __future__ import annotations

import torch


def select_groups(
    scores: torch.Tensor, eligible: torch.Tensor, quota: int, freshness: torch.Tensor
) -> torch.Tensor:
    """Indices of the ``quota`` lowest-score eligible groups, best first.

    Args:
        scores: ``(M,)`` float group scores (lower is better; ``inf`` allowed, NaN is not).
        eligible: ``(M,)`` bool; ineligible groups are never chosen.
        quota: how many to choose (>= 0); fewer are returned if fewer are eligible.
        freshness: ``(M,)`` numbers, larger = fresher; breaks score ties towards the fresher
            group (and, on equal freshness, the lower index).

    Returns:
        ``(min(quota, eligible.sum()),)`` int64 indices into ``scores``.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be (M,), got shape {tuple(scores.shape)}")
    if eligible.shape != scores.shape or freshness.shape != scores.shape:
        raise ValueError(
            f"eligible {tuple(eligible.shape)} and freshness {tuple(freshness.shape)} must "
            f"match scores {tuple(scores.shape)}"
        )
    if quota < 0:
        raise ValueError(f"quota must be >= 0, got {quota}")
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores must not contain NaN")
    candidates = torch.nonzero(eligible.bool()).flatten()  # (E,)
    # Stable sorts, least significant key first: freshness descending, then score ascending.
    by_fresh = candidates[torch.argsort(-freshness[candidates].double(), stable=True)]
    by_score = by_fresh[torch.argsort(scores[by_fresh].double(), stable=True)]
    return by_score[:quota].long()
