"""RMSNorm for the local (non-Transformer-Engine) Qwen3 spec, fused by ``torch.compile`` on GPU.

Megatron's local spec uses ``torch.nn.RMSNorm``, whose CUDA backward goes through the generic
layer-norm gamma/beta reduction. For Qwen3's qk-norm (normalising 128-wide heads over
batch x seq x heads rows) that kernel alone took ~8% of a Qwen3-1.7B fwd+bwd step on an H200
(profiled at 4096 tokens). Compiling the few lines below lets inductor emit one fused kernel
for the forward and one for the backward. The arithmetic is Hugging Face's ``Qwen3RMSNorm``
(normalise in fp32, cast back, then scale). Compiled, about a quarter of its bf16 outputs differ
from the eager arithmetic's, as many as torch's fused ``F.rms_norm`` (H200,
``benchmarks/norm_calls.py``): inductor need not round to bf16 between the two steps. On CPU the
module runs the same arithmetic eagerly (no compiler, exact fp32 parity tests).

A compiled call costs the host 470-960 us for its forward and backward at a 1.7B micro-batch's
shapes, ``F.rms_norm`` 110-240 us (two H200 machines); with ``F.rms_norm`` in its place the train step was not
measurably faster (train_step A/B on H200, inside a 20% spread from run to run).

The compiled function sees ``x`` as a contiguous ``(rows, hidden)`` matrix: q/k-norm inputs are
strided views of the attention projections whose strides differ with the head count and the
micro-batch layout, and dynamo guards on strides, so the raw views recompiled until they hit its
recompile limit (8) and fell back to eager (seen on a DP rank of a 1.7B run). As a matrix the only
varying size is the row count, which ``dynamic=True`` keeps symbolic: one graph per hidden size.

What still recompiles: each hidden size (the weight is a parameter: static), a matrix that is a
view and one that is not (``reshape`` of a contiguous input), each grad mode, and a row count of 1:
9 variants on a 1.7B run, one over dynamo's default limit of 8, past which the last to come (in
grad mode) would run eagerly for the rest of the run. The compiled
norm raises that limit to ``RECOMPILE_LIMIT`` (counted per function, the limit shared: others may
recompile as often, which the benchmark's ``dynamo_compiles_after_first_step`` would show). The
trainer's warm-up calls it at three micro-batch shapes so that these compile before the first
step. The detached, unbacked-rows call of the log-prob kernels (``trainer/kernels.py``), which
never recompiles, made this module (~224 calls per micro-batch, as an autograd Function) cost 30%
of a 1.7B train step on an H200 (benchmarks/results/kernel_ab_*: per-call overhead or the unbacked
rows' code; the A/B did not tell them apart), so the norm keeps the plain compiled call.
``trainer.compiled_kernels=false`` runs the eager arithmetic on GPU too (``Qwen3RMSNorm.compiled``).

Both this norm and the fused layer (``fused_layer.py``) compile with ``compile_dynamic``: inductor's
mix-order reduction (the norm's backward reduces over rows for the input's gradient and over
columns for the weight's, one kernel) checks the row count against fixed sizes before it fuses
(``rows x hidden >= 5 MiB`` elements, ``rows >= 4096``, ``rows >= 2 x hidden``) and guards the graph
on each answer, so micro-batches below 2,560 tokens, at 2,560-4,095, and above compiled three graphs
of one function per grad mode (1.7B, H200, ``TORCH_LOGS=recompiles``). Its non-strict mode makes
the fusion without those checks: no range guard, one graph for every row count.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the normalisation in fp32 and the scale in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def compile_dynamic(fn):
    """``torch.compile(fn, dynamic=True)`` with no range guard on the row count (module docstring);
    a torch without the mix-order non-strict switch compiles as it would."""
    from torch._inductor import config

    strict = "mix_order_reduction_non_strict_mode"
    options = {f"triton.{strict}": True} if hasattr(config.triton, strict) else {}
    return torch.compile(fn, dynamic=True, options=options)


_compiled_rms_norm = None
RECOMPILE_LIMIT = 32  # the variants above can reach 16 (2 hidden sizes x grad modes x view or not x base dim 1)


def _fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    global _compiled_rms_norm
    if _compiled_rms_norm is None:
        _compiled_rms_norm = compile_dynamic(rms_norm_reference)
        limits = torch._dynamo.config  # imported by torch.compile
        limits.recompile_limit = max(limits.recompile_limit, RECOMPILE_LIMIT)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (rows, hidden): see the module docstring
    return _compiled_rms_norm(rows, weight, eps).reshape(x.shape)


class Qwen3RMSNorm(torch.nn.RMSNorm):
    """Drop-in for Megatron's ``WrappedTorchNorm`` (same constructor, same ``weight`` key).
    ``compiled`` (the trainer's ``compiled_kernels``): off, a CUDA input runs the eager arithmetic
    too (several kernels, no dynamo guard or compiled-region call on the host)."""

    compiled = True

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_unused) -> None:
        if config is not None and getattr(config, "sequence_parallel", False):
            raise ValueError("Qwen3RMSNorm (local spec) does not support sequence_parallel")
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.compiled:
            return _fused(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)
