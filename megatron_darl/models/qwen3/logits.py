"""Full-vocabulary logits from a (TP x PP sharded) Megatron Qwen3 model, for checks and eval.

The trainer's log-prob pass never builds full logits (it stays vocab-parallel); this is for
parity tests, converters' self-checks and small-scale evaluation. Two details every consumer of
Megatron logits must respect are here as functions: padded vocab columns must be masked
(their logit is 0, not -inf), and the local (non-SDPA) attention needs an explicit causal mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron_darl.models.qwen3.model import unwrap_qwen3


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, s, s] bool mask in Megatron's convention (``True`` = masked out)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def mask_padded_vocab_(
    logits_shard: torch.Tensor, vocab_size: int, tp_rank: int
) -> torch.Tensor:
    """Set logits of padded vocab rows (global index >= ``vocab_size``) to -inf, in place.

    ``logits_shard`` is this TP rank's vocab slice ``[..., padded_vocab / tp]``.
    """
    width = logits_shard.shape[-1]
    start = tp_rank * width
    if start + width > vocab_size:
        logits_shard[..., max(0, vocab_size - start):] = float("-inf")
    return logits_shard


def gather_vocab_logits(logits_shard: torch.Tensor, vocab_size: int, parallel_state):
    """All-gather vocab-parallel logits over TP and strip the padding: ``[..., vocab_size]``."""
    ps = parallel_state
    if ps.tp_size > 1:
        parts = [torch.empty_like(logits_shard) for _ in range(ps.tp_size)]
        dist.all_gather(parts, logits_shard.contiguous(), group=ps.tp_group)
        logits_shard = torch.cat(parts, dim=-1)
    return logits_shard[..., :vocab_size]


def forward_logits(model_chunks, input_ids: torch.Tensor, parallel_state):
    """Forward ``input_ids`` [b, s] through the pipeline; full logits [b, s, vocab] or None.

    Every rank of the model-parallel group calls it with the same ``input_ids``; the last
    pipeline stage gets the logits (gathered over TP, padding stripped), other stages None.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps = parallel_state
    model = unwrap_qwen3(model_chunks[0])
    b, s = input_ids.shape
    input_ids = input_ids.to(ps.device)
    position_ids = torch.arange(s, device=ps.device).unsqueeze(0).expand(b, s)
    mask = causal_mask(s, ps.device) if getattr(model, "needs_attention_mask", False) else None
    vocab = model.qwen3_spec.vocab_size

    def loss_func(output, non_loss_data=True):
        return gather_vocab_logits(output, vocab, ps)

    def step(data_iterator, chunk):
        return chunk(input_ids, position_ids, mask), loss_func

    for chunk in model_chunks:
        chunk.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([None]), model=model_chunks,
            num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True,
            collect_non_loss_data=True,
        )
    return out[0] if ps.is_last_stage else None
