"""Whether the weights an update produced are finite, before they leave the trainer.

Why: a finite loss and a finite gradient norm do not make finite weights. Adam with ``eps=0``
divides 0 by 0 for every weight whose gradient is zero (``trainer.optimizer.adam_eps=0`` on the
smoke run: 3584 of 16384 embedding values NaN after the first step, gradient norm 0.9). Such a
version, once published, kills a rollout worker much later under another name, and, once
checkpointed, leaves a run that cannot be resumed; so the weights themselves are checked.

``weight_norm`` is one fused norm per rank (``torch._foreach_norm`` over the rank's parameters,
one host sync), summed over the model-parallel group and then over DP, so every rank gets the
same number and refuses together (a rank alone would hang the others' collectives). NaN and
Inf survive a sum, so a single bad value anywhere shows. The value is the global L2 norm up to
replication (weights held by several TP ranks or by both ends of the pipeline count once per
holder), which is enough for a finiteness check and a trend in the metrics. At TP = PP = DP = 1
it costs no collective at all.

``require_finite`` is the check before a checkpoint: a non-finite version is refused with
``WeightsNotFinite`` before anything is written, so no checkpoint of it can exist.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class WeightsNotFinite(RuntimeError):
    """The current weights hold NaN or Inf: they must be neither published nor saved."""


@torch.no_grad()
def local_sum_of_squares(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(1,) float64 on ``device``: the sum of squares of ``params`` (one fused norm kernel)."""
    tensors = [p.detach() for p in params if p.numel()]
    if not tensors:
        return torch.zeros(1, dtype=torch.float64, device=device)
    try:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)  # one kernel per dtype/device
    except TypeError:  # a torch before _foreach_norm's dtype: bf16 norms, still NaN/Inf where it matters
        norms = torch._foreach_norm(tensors, 2)
    return torch.stack([n.float() for n in norms]).double().pow(2).sum().reshape(1).to(device)


def weight_norm(model_chunks: list, ps) -> float:
    """Collective over every trainer rank: the weights' L2 norm (see the module docstring);
    NaN or Inf when any rank holds a non-finite weight. The same value on every rank."""
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    total = local_sum_of_squares(params, ps.device)
    if ps.tp_size * ps.pp_size > 1:
        dist.all_reduce(total, group=ps.model_parallel_group)
    if ps.dp_size > 1:  # replicas hold the same weights; a sum keeps a NaN of any one of them
        dist.all_reduce(total, group=ps.dp_group)
        total /= ps.dp_size
    return math.sqrt(float(total.item()))


def require_finite(trainer, what: str) -> float:
    """Collective: the weight norm, or ``WeightsNotFinite`` on every rank naming ``what`` (the
    checkpoint or the publish that was refused) and the trainer's version."""
    norm = weight_norm(trainer.model_chunks, trainer.ps)
    if not math.isfinite(norm):
        raise WeightsNotFinite(
            f"{what} refused: the weights of version {trainer.version} (optimizer step {trainer.optimizer_steps}) hold NaN "
            f"or Inf (weight norm {norm}); a non-finite version is never saved nor published")
    return norm
