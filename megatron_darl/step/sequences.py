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

Samples are packed into this layout once, when the replay buffer takes their group
(``samples.PackedSamples``, ``BufferEntry.packed``): a step's batches (the log-prob pass, each
backfill pass, the mini-batches) are one concatenation of packed groups or a view of one
(``packed_batch``), and the engine log-probs of a candidate set are the same concatenation, not a
re-pack of each sample's row. ``benchmarks/step_batches.py`` counts the copies.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_darl.samples import PackedSamples, Sample, pack_samples
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


def packed_batch(packed: PackedSamples, loss_inputs: Any = None) -> TrainBatch:
    """The ``TrainBatch`` of already packed samples, scored on their response tokens (no copy).

    Args:
        packed: the N samples, in batch order (e.g. ``PackedSamples.concat`` of buffered groups).
        loss_inputs: per-token inputs of the loss in the packed layout of these samples (e.g.
            ``PolicyLossInputs``), or None for a log-prob pass.
    """
    return TrainBatch(packed.input_ids, packed.seq_lens, packed.loss_mask, loss_inputs)


def sequence_batch(samples: Sequence[Sample], loss_inputs: Any = None) -> TrainBatch:
    """Pack samples into a ``TrainBatch`` scored on their response tokens (``pack_samples``:
    an empty prompt is refused, by sample id)."""
    if not samples:
        raise ValueError("cannot build a TrainBatch from zero samples")
    return packed_batch(pack_samples(samples), loss_inputs)
