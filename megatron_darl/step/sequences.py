"""Samples -> the trainer's ``TrainBatch``, and the one token layout of the loop: packed scored tokens.

A sample becomes one sequence ``prompt_ids ++ response_ids`` whose loss mask covers exactly the
response tokens. The trainer scores position p with ``log p(token_p | tokens_<p)`` and never
scores a sequence's first token (``trainer/batch.py``), so a response token j sits at position
``P + j`` and a sample needs at least one prompt token; an empty prompt is refused here, by
sample id, rather than silently losing the first response token.

The scored tokens of such a batch, in order, are the samples' response tokens end to end: the
*packed layout*, ``(n,)`` with ``n = sum_i T_i``. Every per-token value of a step lives in it,
from the log-prob pass (``compute_logprobs`` returns it) through the cache rows (slices of it),
the scores, the behavior weights and the loss inputs (``PolicyLossInputs``), to the ``logp`` the
loss sees; a PPO mini-batch of contiguous samples is a contiguous slice of it. Chosen over padded
``(N, T_max)`` rows because RL response lengths are long-tailed: ``benchmarks/token_layout.py``
measures the planner step in both layouts.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_darl.samples import Sample
from megatron_darl.trainer.batch import TrainBatch


def response_lengths(samples: Sequence[Sample]) -> torch.Tensor:
    """``(N,)`` int64 response tokens of each sample: the segment lengths of the packed layout."""
    return torch.tensor([s.num_tokens for s in samples], dtype=torch.int64)


def sample_index(lengths: torch.Tensor) -> torch.Tensor:
    """``(n,)`` int64 the sample each packed token belongs to."""
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def pack(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample ``(T_i,)`` rows end to end: ``(n,)`` float32."""
    return torch.cat([r.to(torch.float32).reshape(-1) for r in rows]) if rows else torch.zeros(0)


def _check_prompt(sample: Sample) -> None:
    if sample.prompt_ids.shape[0] < 1:
        raise ValueError(
            f"sample {sample.sample_id} has an empty prompt: the trainer never scores a "
            "sequence's first token, so the first response token would be lost"
        )


def sequence_batch(samples: Sequence[Sample], loss_inputs: Any = None) -> TrainBatch:
    """Pack samples into a ``TrainBatch`` scored on their response tokens.

    Args:
        samples: the N samples, in batch order.
        loss_inputs: per-token inputs of the loss in the packed layout of these samples (e.g.
            ``PolicyLossInputs``), or None for a log-prob pass.
    """
    if not samples:
        raise ValueError("cannot build a TrainBatch from zero samples")
    tokens, masks = [], []
    for s in samples:
        _check_prompt(s)
        p, t = s.prompt_ids.shape[0], s.num_tokens
        tokens.append(torch.cat([s.prompt_ids.long(), s.response_ids.long()]))
        masks.append(torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(t, dtype=torch.bool)]))
    return TrainBatch.from_sequences(tokens, masks, loss_inputs)
