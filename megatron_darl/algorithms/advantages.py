"""GRPO group-normalised advantages (docs/algorithm.md, section 1).

Advantages are computed once per group when it arrives and then travel with the group through
the replay buffer, so a replayed group keeps the advantage it was born with. Groups whose
rewards are all equal carry an advantage of exactly zero (not a rounding residue), which is what
lets the buffer recognise them as degenerate.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample GRPO advantages ``A_i = (R_i - mean_g R) / (std_g R + eps)``.

    ``std_g`` is the unbiased (Bessel-corrected) standard deviation over the group, as in
    DeepSeekMath/verl/slime. Groups of one sample, or whose rewards are all equal, get exactly 0.

    Args:
        rewards: ``(N,)`` float rewards.
        group_index: ``(N,)`` integer group label of each sample (any integers; need not be
            contiguous or sorted).
        eps: added to the standard deviation; must be >= 0.

    Returns:
        ``(N,)`` float32 advantages.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_index.shape != rewards.shape:
        raise ValueError(
            f"group_index shape {tuple(group_index.shape)} must equal rewards shape "
            f"{tuple(rewards.shape)}"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)

    r = rewards.to(torch.float64)  # (N,) float64: exact zero for equal rewards, no overflow
    _, inverse = torch.unique(group_index, return_inverse=True)  # (N,) in [0, M)
    num_groups = int(inverse.max()) + 1
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )  # (M,)
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count  # (M,)
    centered = r - mean[inverse]  # (N,)
    sq = torch.zeros_like(count).index_add_(0, inverse, centered * centered)  # (M,)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))  # (M,) unbiased
    lo = torch.full_like(count, float("inf")).scatter_reduce_(0, inverse, r, "amin")
    hi = torch.full_like(count, float("-inf")).scatter_reduce_(0, inverse, r, "amax")
    degenerate = (hi == lo)[inverse]  # (N,) all rewards equal (includes groups of one)
    adv = torch.where(degenerate, torch.zeros_like(r), centered / (std[inverse] + eps))
    return adv.to(torch.float32)


def rewards_equal(rewards: torch.Tensor) -> bool:
    """True when a group's ``(G,)`` rewards are all equal (a group of one included): the group is
    degenerate, its GRPO advantages are exactly zero and it carries no policy gradient (the rule
    ``grpo_advantages`` applies). An empty group is not: it has no rewards to compare."""
    r = rewards.to(torch.float64)  # (G,) the same comparison as grpo_advantages
    return r.numel() > 0 and bool(r.max() == r.min())
