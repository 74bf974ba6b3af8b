"""RMSNorm for the local (non-Transformer-Engine) Qwen3 spec, fused by ``torch.compile`` on GPU.

Megatron's local spec uses ``torch.nn.RMSNorm``, whose CUDA backward goes through the generic
layer-norm gamma/beta reduction. For Qwen3's qk-norm (normalising 128-wide heads over
batch x seq x heads rows) that kernel alone took ~8% of a Qwen3-1.7B fwd+bwd step on an H200
(profiled at 4096 tokens). Compiling the few lines below lets inductor emit one fused kernel
for the forward and one for the backward. The arithmetic is Hugging Face's ``Qwen3RMSNorm``
(normalise in fp32, cast back, then scale), so bf16 outputs round the same way as the
reference model. On CPU the module runs the same arithmetic eagerly (no compiler, exact fp32
parity tests).

On GPU the forward and the backward are each one compiled kernel over a ``(rows, hidden)`` matrix,
written out as an autograd Function: q/k-norm inputs are strided views of the attention
projections, and dynamo guards on views, ``requires_grad`` and (through inductor's fusion choices)
ranges of the row count, so compiling the module's arithmetic under autograd recompiled with the
micro-batch layout (``models/kernels.py`` says which guards and how ``fused`` avoids them). The
backward is the derivative of the reference (the fp32 cast counts as the identity, as autograd
treats it), with the weight's gradient summed over rows in fp32.
"""

from __future__ import annotations

import torch

from megatron_darl.models.kernels import fused


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the normalisation in fp32 and the scale in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _forward_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


def _backward_rows(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(d x, d weight) of ``rms_norm_reference`` at ``x`` (rows, hidden) for ``grad`` (rows, hidden)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (rows, 1)
    normed = x32 * rstd
    grad_normed = (grad * weight).float()
    grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    grad_weight = (grad.float() * normed.to(x.dtype).float()).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


_KERNELS: dict = {}


def _kernel(name: str):
    if name not in _KERNELS:  # compiled on first use: importing this module compiles nothing
        _KERNELS["forward"] = fused(_forward_rows, rows=(0,))
        _KERNELS["backward"] = fused(_backward_rows, rows=(0, 1))
    return _KERNELS[name]


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, eps):  # noqa: D401
        ctx.save_for_backward(rows, weight)
        ctx.eps = eps
        return _kernel("forward")(rows, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        grad_x, grad_weight = _kernel("backward")(grad.contiguous(), rows, weight, ctx.eps)
        return grad_x, grad_weight, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_reference`` over the last dimension of ``x`` with compiled forward and backward
    kernels (any device; the module uses it on CUDA)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (rows, hidden)
    return _FusedRMSNorm.apply(rows, weight, eps).reshape(x.shape)


class Qwen3RMSNorm(torch.nn.RMSNorm):
    """Drop-in for Megatron's ``WrappedTorchNorm`` (same constructor, same ``weight`` key)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_unused) -> None:
        if config is not None and getattr(config, "sequence_parallel", False):
            raise ValueError("Qwen3RMSNorm (local spec) does not support sequence_parallel")
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused_rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)
