"""One call of Megatron's pipeline schedule over a step's padded micro-batches.

Megatron's ``get_forward_backward_func()`` picks the schedule (no pipelining at PP = 1, 1F1B
otherwise). Every rank of a DP replica iterates the same micro-batches; only the last stage
turns the logits into per-token log-probs (``logprobs.vocab_parallel_logprobs``, restricted to
the scored positions) and hands them to ``on_logprobs``, which returns what Megatron's schedule
expects from a loss function: ``(loss_sum, num_tokens, reduced)``. Micro-batches keep their own
padded shapes (``variable_seq_lengths``; see ``batch.py``), so the ``seq_length`` and
``micro_batch_size`` given to the schedule are only upper bounds.

With ``entropy=True`` (an entropy bonus in the loss) the last stage takes the log-probs and the
per-token entropies in one pass (``logprobs.vocab_parallel_logprobs_entropy``) and calls
``on_logprobs(logp, mb, entropy)``; otherwise the log-prob-only path runs as it always has.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_darl.trainer.batch import MicroBatch
from megatron_darl.trainer.logprobs import vocab_parallel_logprobs, vocab_parallel_logprobs_entropy

# (logp (n,) fp32, micro-batch[, entropy (n,) fp32]) -> (loss_sum scalar, num_tokens int scalar, reduced dict)
LastStageFn = Callable[[torch.Tensor, MicroBatch], tuple]


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """(1, 1, S, S) bool, True above the diagonal (Megatron's "masked out" convention)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def run_schedule(
    model: list,
    microbatches: list[MicroBatch],
    on_logprobs: LastStageFn,
    *,
    forward_only: bool,
    tp_group,
    vocab_size: int,
    chunk_tokens: int,
    needs_attention_mask: bool,
    temperature: float = 1.0,
    entropy: bool = False,
) -> None:
    """Run forward (and backward unless ``forward_only``) over ``microbatches``.

    Gradients accumulate in the DDP buffers; with ``forward_only=False`` Megatron's
    ``finalize_model_grads`` (set on the model config by the trainer) reduces and scales them.
    Log-probs are of ``softmax(logits / temperature)``, the sampler's density; with ``entropy``
    its per-token entropy is passed to ``on_logprobs`` too.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        mb: MicroBatch = next(data_iterator)
        mask = causal_mask(mb.shape[1], mb.input_ids.device) if needs_attention_mask else None
        output = chunk(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mask)

        def loss_func(logits: torch.Tensor):
            # logits: (B, S, V / TP) on the last stage
            flat = logits.reshape(-1, logits.shape[-1])
            if entropy:
                return _with_entropy(flat, mb, on_logprobs, tp_group, vocab_size, chunk_tokens, temperature)
            if 2 * mb.pred_rows.numel() >= flat.shape[0]:
                # Mostly scored: score every row (targets 0 elsewhere) and pick the scored
                # values; cheaper than copying the rows out and scattering their gradient back.
                targets = torch.zeros(flat.shape[0], dtype=mb.targets.dtype, device=flat.device)
                targets[mb.pred_rows] = mb.targets
                flat = _mask_padded_vocab(flat, vocab_size, tp_group)
                logp = vocab_parallel_logprobs(flat, targets, tp_group, chunk_tokens,
                                               temperature)[mb.pred_rows]
            else:
                rows = _mask_padded_vocab(flat.index_select(0, mb.pred_rows), vocab_size, tp_group)
                logp = vocab_parallel_logprobs(rows, mb.targets, tp_group, chunk_tokens, temperature)
            return on_logprobs(logp, mb)

        return output, loss_func

    rows = max(mb.shape[0] for mb in microbatches)
    seq = max(mb.shape[1] for mb in microbatches)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def _with_entropy(flat, mb: MicroBatch, on_logprobs: LastStageFn, tp_group, vocab_size: int,
                  chunk_tokens: int, temperature: float):
    """``on_logprobs(logp, mb, entropy)`` over the scored rows of ``flat`` (B * S, V / TP); like the
    log-prob-only path, every row when most are scored (no copy of the logits), else a copy of those."""
    if 2 * mb.pred_rows.numel() >= flat.shape[0]:
        targets = torch.zeros(flat.shape[0], dtype=mb.targets.dtype, device=flat.device)
        targets[mb.pred_rows] = mb.targets
        flat = _mask_padded_vocab(flat, vocab_size, tp_group)
        logp, entropy = vocab_parallel_logprobs_entropy(flat, targets, tp_group, chunk_tokens, temperature)
        return on_logprobs(logp[mb.pred_rows], mb, entropy[mb.pred_rows])
    rows = _mask_padded_vocab(flat.index_select(0, mb.pred_rows), vocab_size, tp_group)
    logp, entropy = vocab_parallel_logprobs_entropy(rows, mb.targets, tp_group, chunk_tokens, temperature)
    return on_logprobs(logp, mb, entropy)


def _mask_padded_vocab(rows: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    """Give the padded vocabulary columns (ids >= ``vocab_size``) the lowest finite logit.

    Megatron pads the vocabulary to a multiple of 128; those rows are zero in the checkpoint and
    would otherwise add exp(0) terms to the softmax that Hugging Face and vLLM do not have.
    (Finite, not -inf, so a TP shard made only of padding still has a finite local max.)
    """
    import torch.distributed as dist

    v_local = rows.shape[-1]
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    start = tp_rank * v_local
    if start + v_local <= vocab_size:
        return rows
    keep = torch.arange(start, start + v_local, device=rows.device) < vocab_size
    return rows.masked_fill(~keep, torch.finfo(rows.dtype).min)
