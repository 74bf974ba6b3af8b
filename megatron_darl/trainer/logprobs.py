"""Per-token log-probabilities from vocab-parallel logits, in fp32 chunks, differentiable.

With a 151,936-token vocabulary the fp32 logits of one 4096-token sequence are 2.5 GB, so the
log-softmax is never taken over the whole batch at once: each TP rank holds ``V / TP`` vocabulary
columns of the (bf16 on GPU) logits of the scored positions only, and this function walks them in
chunks of ``chunk_tokens`` rows, upcasting one chunk at a time:

    log p(y) = logit_y - logsumexp_v logit_v,  logsumexp via an all-reduce of the max and of
    the sum of exponentials over the TP group; logit_y via an all-reduce of the one rank's value.

The backward pass recomputes the softmax chunk by chunk from the saved logits and the saved
(N,) log-sum-exp, so it also never holds more than one fp32 chunk:
``d logp / d logit_v = 1[v = y] - softmax_v``. The TP group is passed explicitly (not read from
Megatron's globals); with TP = 1 no collective runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, chunk_tokens):  # noqa: D401
        n, v_local = logits.shape
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        local = targets - vocab_start
        in_range = (local >= 0) & (local < v_local)  # (n,) bool
        local = torch.where(in_range, local, torch.zeros_like(local))
        lse = torch.empty(n, dtype=acc, device=logits.device)
        target_logit = torch.empty(n, dtype=acc, device=logits.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            x = logits[start:end].to(acc)  # (c, V/tp) fp32: one chunk only
            row_max = x.max(dim=-1).values
            _all_reduce(row_max, dist.ReduceOp.MAX, group)
            sum_exp = torch.exp(x - row_max.unsqueeze(-1)).sum(dim=-1)
            _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
            lse[start:end] = row_max + torch.log(sum_exp)
            picked = x.gather(-1, local[start:end].unsqueeze(-1)).squeeze(-1)
            target_logit[start:end] = torch.where(in_range[start:end], picked, 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits, local, in_range, lse)
        ctx.chunk_tokens = chunk_tokens
        return target_logit - lse

    @staticmethod
    def backward(ctx, grad_out):
        logits, local, in_range, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        grad_out = grad_out.to(lse.dtype)
        for start in range(0, logits.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, logits.shape[0])
            g = grad_out[start:end].unsqueeze(-1)  # (c, 1)
            grad = torch.exp(logits[start:end].to(lse.dtype) - lse[start:end].unsqueeze(-1)).mul_(-g)
            hit = in_range[start:end].to(grad.dtype).unsqueeze(-1) * g
            grad.scatter_add_(-1, local[start:end].unsqueeze(-1), hit)
            grad_logits[start:end] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Log-probabilities of ``targets`` under vocab-parallel ``logits``.

    Args:
        logits: (n, V / TP) this rank's vocabulary slice, any float dtype; rank r holds columns
            ``[r * V / TP, (r + 1) * V / TP)`` (Megatron's ``VocabParallelEmbedding`` layout).
        targets: (n,) int64 global token ids.
        tp_group: the tensor-parallel process group (None or size 1: no collective).
        chunk_tokens: rows upcast to fp32 at a time.

    Returns:
        (n,) fp32 (fp64 for fp64 logits) log-probabilities, identical on every TP rank; differentiable w.r.t. ``logits``.
    """
    assert logits.dim() == 2 and targets.shape == logits.shape[:1], (logits.shape, targets.shape)
    tp_rank = dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0
    vocab_start = tp_rank * logits.shape[1]
    return _VocabParallelLogProb.apply(logits, targets, vocab_start, tp_group, chunk_tokens)
