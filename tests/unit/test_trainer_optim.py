"""The stand-ins for apex's multi-tensor kernels (trainer/optim.py): the same values as
megatron-core's own fallbacks, without their one host sync per tensor, swapped in once."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_darl.trainer import cpu_compat
from megatron_darl.trainer.optim import foreach_l2_norm, foreach_scale, use_foreach_fallbacks

cpu_compat.import_megatron()


class AtenOps(TorchDispatchMode):
    """Every aten op run inside it (an ``.item()`` shows as ``_local_scalar_dense``: a host sync
    on a GPU), C++ callers included."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def syncs(self) -> int:
        return sum("_local_scalar_dense" in op for op in self.ops)


def _grads():
    g = torch.Generator().manual_seed(3)
    return [[torch.randn(64, 32, generator=g), torch.randn(17, generator=g).bfloat16(),
             torch.randn(5, 5, generator=g) * 1e3, torch.randn(300, generator=g)]]


def test_l2_norm_matches_megatrons_fallback_without_a_host_sync_per_tensor():
    from megatron.core.utils import local_multi_tensor_l2_norm

    grads = _grads()
    with cpu_compat.CpuDeviceMode(), AtenOps() as theirs_ops:  # theirs allocates on "cuda"
        theirs, _ = local_multi_tensor_l2_norm(2048 * 32, None, grads, False)
    with AtenOps() as ours_ops:
        ours, _ = foreach_l2_norm(2048 * 32, None, grads, False)
    exact = sum(t.double().pow(2).sum() for group in grads for t in group).sqrt()
    assert ours.shape == (1,) and ours.dtype == torch.float32
    assert float(ours) == pytest.approx(float(exact), rel=1e-6)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert theirs_ops.syncs() >= 1  # the check can fail: Megatron's own reads the norms back
    assert ours_ops.syncs() == 0
    split = [grads[0][:1], grads[0][1:]]  # several lists: one norm over all of them
    assert float(foreach_l2_norm(0, None, split, False)[0]) == pytest.approx(float(exact), rel=1e-6)
    nan = [[torch.ones(3), torch.tensor([float("nan")])]]
    assert torch.isnan(foreach_l2_norm(0, None, nan, False)[0]).all()  # a NaN gradient still shows


def test_scale_writes_src_times_scale_into_dst_in_dst_dtype():
    src = [torch.randn(8, 4), torch.randn(3)]
    dst = [torch.zeros(8, 4, dtype=torch.bfloat16), torch.zeros(3)]
    foreach_scale(0, None, [src, dst], 0.5)
    assert dst[0].dtype == torch.bfloat16
    assert torch.equal(dst[0], (src[0] * 0.5).bfloat16())
    assert torch.equal(dst[1], src[1] * 0.5)
    foreach_scale(0, None, [[], []], 2.0)  # nothing to scale is not an error


def test_fallbacks_are_swapped_once_and_only_where_megatron_fell_back(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as base

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    monkeypatch.setattr(base, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    assert use_foreach_fallbacks() == 3
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale and base.multi_tensor_scale_impl is foreach_scale
    assert use_foreach_fallbacks() == 0  # idempotent
    kernel = object()  # what TE or apex would have supplied
    monkeypatch.setattr(clip_grads, "l2_norm_impl", kernel)
    assert use_foreach_fallbacks() == 0 and clip_grads.l2_norm_impl is kernel
