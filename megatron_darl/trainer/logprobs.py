"""Per-token log-probabilities from vocab-parallel logits, in fp32 chunks, differentiable.

With a 151,936-token vocabulary the fp32 logits of one 4096-token sequence are 2.5 GB, so the
log-softmax is never taken over the whole batch at once: each TP rank holds ``V / TP`` vocabulary
columns of the (bf16 on GPU) logits of the scored positions only, and this function walks them in
chunks of ``chunk_tokens`` rows, upcasting one chunk at a time:

    log p(y) = logit_y - logsumexp_v logit_v,  logsumexp via an all-reduce of the max and of
    the sum of exponentials over the TP group; logit_y via an all-reduce of the one rank's value.

The backward pass recomputes the softmax chunk by chunk from the saved logits and the saved
(N,) log-sum-exp, so it also never holds more than one fp32 chunk:
``d logp / d logit_v = 1[v = y] - softmax_v``. On CUDA each per-chunk pass (row max, sum of
exponentials, gradient) is one ``torch.compile``-fused kernel that reads the bf16 logits once
and materialises no fp32 copy: the eager version spent ~10% of a Qwen3-1.7B train step (H200,
vocab 151,936) on upcasts and elementwise passes. The TP group is passed explicitly (not read from
Megatron's globals); with TP = 1 no collective runs.

Sampling temperature: the rollout engines sample from ``softmax(logits / T)`` and report that
density, so the trainer must score the same one (docs/algorithm.md, Densities). ``scale = 1 / T``
multiplies each upcast chunk inside the same kernels (no scaled copy of the bf16 logits is made) and
the gradient picks up the same factor; at ``scale = 1`` the arithmetic is exactly the unscaled one.

Entropy (``vocab_parallel_logprobs_entropy``, for an entropy bonus in the loss): the per-token
entropy of the same scaled distribution, ``H = lse - sum_v p_v z_v`` with ``z = scale * logits``,
needs one more per-row sum, ``sum_v exp(z_v - max) (z_v - max)``, taken in the sum-of-exponentials
pass and all-reduced with it (one collective of two columns instead of one); its gradient,
``dH/dz_v = -p_v (log p_v + H)``, joins the log-prob's in the same backward kernel. It is a
separate autograd function: the log-prob-only path is untouched and pays nothing for it.
Differences ``z - max`` are clamped at ``-1e4`` before they multiply a probability: the exponential
is exactly 0 there in fp32 and fp64 alike, and a padded column at the dtype's lowest value (times
``1 / T > 1``: ``-inf``) gives ``0 * -1e4 = 0``, not ``0 * -inf = NaN``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_darl.trainer.kernels import fused


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _row_max(x: torch.Tensor, acc: torch.dtype, scale: float) -> torch.Tensor:
    return x.to(acc).amax(dim=-1) * scale  # scale > 0 commutes with the max


def _row_sum_exp(x: torch.Tensor, row_max: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.exp(x.to(row_max.dtype) * scale - row_max.unsqueeze(-1)).sum(dim=-1)


def _chunk_grad(x, lse, g, local, in_range, scale: float) -> torch.Tensor:
    """d(logp)/d(logits) * g for one chunk: scale * (1[v = y] - softmax_v) * g, in x's dtype."""
    prob = torch.exp(x.to(lse.dtype) * scale - lse.unsqueeze(-1))
    cols = torch.arange(x.shape[-1], device=x.device).unsqueeze(0)
    onehot = ((cols == local.unsqueeze(-1)) & in_range.unsqueeze(-1)).to(lse.dtype)
    return ((onehot - prob) * (g * scale).unsqueeze(-1)).to(x.dtype)


_COMPILED: dict = {}


def _kernel(fn, x: torch.Tensor, rows: tuple[int, ...] = (0, 1, 2, 3, 4)):
    """``fn`` fused by ``torch.compile`` on CUDA (one read of the bf16 chunk per pass, no fp32
    copy of it), compiled once for every chunk size and pass (``kernels.py``; ``rows``: the
    positions of its per-row tensor arguments); eager elsewhere, so CPU results are plain PyTorch
    arithmetic."""
    if not x.is_cuda:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = fused(fn, rows=rows)
    return _COMPILED[fn]


def _local_targets(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int):
    """(column of each target in this rank's slice or 0, whether it is in the slice), both (n,)."""
    local = targets - vocab_start
    in_range = (local >= 0) & (local < logits.shape[1])  # (n,) bool
    return torch.where(in_range, local, torch.zeros_like(local)), in_range


def _target_logits(logits, local, in_range, acc: torch.dtype, scale: float, group) -> torch.Tensor:
    """(n,) scaled logit of each target, summed over the TP group (one rank holds each)."""
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).to(acc) * scale
    target_logit = torch.where(in_range, picked, torch.zeros_like(picked))
    _all_reduce(target_logit, dist.ReduceOp.SUM, group)
    return target_logit


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, chunk_tokens, scale):  # noqa: D401
        n = logits.shape[0]
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        local, in_range = _local_targets(logits, targets, vocab_start)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        for start in range(0, n, chunk_tokens):
            x = logits[start : start + chunk_tokens]  # (c, V/tp) never upcast as a whole
            row_max = _kernel(_row_max, x)(x, acc, scale)
            _all_reduce(row_max, dist.ReduceOp.MAX, group)
            sum_exp = _kernel(_row_sum_exp, x)(x, row_max, scale)
            _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
            lse[start : start + chunk_tokens] = row_max + torch.log(sum_exp)
        target_logit = _target_logits(logits, local, in_range, acc, scale, group)
        ctx.save_for_backward(logits, local, in_range, lse)
        ctx.chunk_tokens, ctx.scale = chunk_tokens, scale
        return target_logit - lse

    @staticmethod
    def backward(ctx, grad_out):
        logits, local, in_range, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        grad_out = grad_out.to(lse.dtype).contiguous()  # a sum's gradient arrives with stride 0
        for start in range(0, logits.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, logits.shape[0])
            x = logits[start:end]
            grad_logits[start:end] = _kernel(_chunk_grad, x)(
                x, lse[start:end], grad_out[start:end], local[start:end], in_range[start:end],
                ctx.scale,
            )
        return grad_logits, None, None, None, None, None


_FLOOR = -1e4  # z - max below this has exp() == 0 exactly (fp32 and fp64); clamped so 0 * z stays 0


def _row_sums(x: torch.Tensor, row_max: torch.Tensor, scale: float) -> torch.Tensor:
    """(c, 2): per row ``sum exp(z - m)`` and ``sum exp(z - m) (z - m)``, ``z = x * scale``."""
    d = (x.to(row_max.dtype) * scale - row_max.unsqueeze(-1)).clamp(min=_FLOOR)
    e = torch.exp(d)
    return torch.stack([e.sum(dim=-1), (e * d).sum(dim=-1)], dim=-1)


def _chunk_grad_entropy(x, lse, ent, g, gh, local, in_range, scale: float) -> torch.Tensor:
    """Gradient of ``g * logp + gh * H`` w.r.t. one chunk of logits, in x's dtype:
    ``scale * (g (1[v = y] - p_v) - gh p_v (log p_v + H))``."""
    logp = (x.to(lse.dtype) * scale - lse.unsqueeze(-1)).clamp(min=_FLOOR)
    prob = torch.exp(logp)
    cols = torch.arange(x.shape[-1], device=x.device).unsqueeze(0)
    onehot = ((cols == local.unsqueeze(-1)) & in_range.unsqueeze(-1)).to(lse.dtype)
    grad = (onehot - prob) * g.unsqueeze(-1) - prob * (logp + ent.unsqueeze(-1)) * gh.unsqueeze(-1)
    return (grad * scale).to(x.dtype)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Log-probs of the targets and entropies of the rows, of ``softmax(logits * scale)``."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, chunk_tokens, scale):  # noqa: D401
        n = logits.shape[0]
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        local, in_range = _local_targets(logits, targets, vocab_start)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        ent = torch.empty(n, dtype=acc, device=logits.device)
        for start in range(0, n, chunk_tokens):
            x = logits[start : start + chunk_tokens]  # (c, V/tp)
            row_max = _kernel(_row_max, x)(x, acc, scale)
            _all_reduce(row_max, dist.ReduceOp.MAX, group)
            sums = _kernel(_row_sums, x, (0, 1))(x, row_max, scale)  # (c, 2)
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_s = torch.log(sums[:, 0])
            lse[start : start + chunk_tokens] = row_max + log_s
            ent[start : start + chunk_tokens] = log_s - sums[:, 1] / sums[:, 0]
        target_logit = _target_logits(logits, local, in_range, acc, scale, group)
        ctx.save_for_backward(logits, local, in_range, lse, ent)
        ctx.chunk_tokens, ctx.scale = chunk_tokens, scale
        return target_logit - lse, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, local, in_range, lse, ent = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        grad_logp = grad_logp.to(lse.dtype).contiguous()  # a sum's gradient arrives with stride 0
        grad_ent = grad_ent.to(lse.dtype).contiguous()
        kernel = _kernel(_chunk_grad_entropy, logits, (0, 1, 2, 3, 4, 5, 6))
        for start in range(0, logits.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, logits.shape[0])
            grad_logits[start:end] = kernel(
                logits[start:end], lse[start:end], ent[start:end], grad_logp[start:end],
                grad_ent[start:end], local[start:end], in_range[start:end], ctx.scale,
            )
        return grad_logits, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    chunk_tokens: int = 4096,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probabilities of ``targets`` under vocab-parallel ``softmax(logits / temperature)``.

    Args:
        logits: (n, V / TP) this rank's vocabulary slice, any float dtype; rank r holds columns
            ``[r * V / TP, (r + 1) * V / TP)`` (Megatron's ``VocabParallelEmbedding`` layout).
        targets: (n,) int64 global token ids.
        tp_group: the tensor-parallel process group (None or size 1: no collective).
        chunk_tokens: rows upcast to fp32 at a time.
        temperature: T > 0 of the sampled distribution (1: the raw softmax).

    Returns:
        (n,) fp32 (fp64 for fp64 logits) log-probabilities, identical on every TP rank; differentiable w.r.t. ``logits``.
    """
    assert logits.dim() == 2 and targets.shape == logits.shape[:1], (logits.shape, targets.shape)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tp_rank = dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0
    vocab_start = tp_rank * logits.shape[1]
    return _VocabParallelLogProb.apply(logits, targets, vocab_start, tp_group, chunk_tokens,
                                       1.0 / float(temperature))


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    chunk_tokens: int = 4096,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``vocab_parallel_logprobs`` and, per row, the entropy of ``softmax(logits / temperature)``
    over the whole vocabulary (module docstring); same arguments.

    Returns:
        ``(logp, entropy)``: both (n,) fp32 (fp64 for fp64 logits), identical on every TP rank,
        both differentiable w.r.t. ``logits``.
    """
    assert logits.dim() == 2 and targets.shape == logits.shape[:1], (logits.shape, targets.shape)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tp_rank = dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0
    vocab_start = tp_rank * logits.shape[1]
    return _VocabParallelLogProbEntropy.apply(logits, targets, vocab_start, tp_group, chunk_tokens,
                                              1.0 / float(temperature))
