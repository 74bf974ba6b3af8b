"""``torch.compile`` for the vocab-parallel log-prob kernels, called so that each compiles once per
run and never again after the trainer's warm-up.

Dynamo guards on more than a tensor's sizes. Three guards recompiled the fused kernels after the
first trained step on a cold 1.7B run (H200, ``TORCH_LOGS=recompiles``):

* a view and a fresh tensor compile separately (the guard reads ``x._base``), and a view's guard
  also reads its base's size, so a chunk that covers the whole logits differs from one that doesn't;
* ``requires_grad`` differs between the log-prob pass and the train step;
* inductor's fusion choices place range guards on a dynamic row count (``2560 <= rows <= 4095``),
  so a micro-batch outside the range compiles again, up to dynamo's limit of 8, then runs eagerly.

So a kernel built by ``fused`` sees only detached tensors (no base, no ``requires_grad``: its callers
are autograd Functions that write their own backward) whose leading dimension is marked unbacked,
on which no range guard can be placed. One graph per kernel, trailing sizes and dtypes remains.
The row count of the call that compiles is given as inductor's hint (``hint_override``: it steers
only heuristics such as block sizes, never a guard). Here it runs a few times per micro-batch and costs
nothing measurable (H200, 1.7B: 38.9k train tokens/s against 39.8k before); RMSNorm through the same
wrapper (~224 calls per micro-batch) cost 30%, so it keeps the plain compiled call
(``models/qwen3/norm.py``).
"""

from __future__ import annotations

from typing import Callable

import torch


def fused(fn: Callable, rows: tuple[int, ...] = (0,)) -> Callable:
    """``fn`` compiled once for any row count: the tensor arguments at positions ``rows`` (which
    share the leading row dimension) are marked unbacked, every tensor argument is detached."""
    compiled = torch.compile(fn, dynamic=True)

    def call(*args):
        prepared = []
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                arg = arg.detach()
                if i in rows and arg.dim() > 0:
                    _mark_rows(arg)
            prepared.append(arg)
        return compiled(*prepared)

    call.__wrapped__ = fn
    return call


def _mark_rows(t: torch.Tensor) -> None:
    """Dimension 0 unbacked, hinted with its current size (torch without ``hint_override``: bare)."""
    try:
        torch._dynamo.decorators.mark_unbacked(t, 0, hint_override=max(2, int(t.shape[0])))
    except TypeError:
        torch._dynamo.decorators.mark_unbacked(t, 0)
