"""Samples <-> the trainer's packed ``TrainBatch`` and back, with the token alignment in one place.

A sample becomes one sequence ``prompt_ids ++ response_ids`` whose loss mask covers exactly the
response tokens. The trainer scores position p with ``log p(token_p | tokens_<p)`` and never
scores a sequence's first token (``trainer/batch.py``), so a response token j sits at position
``P + j`` and a sample needs at least one prompt token; an empty prompt is refused here, by
sample id, rather than silently losing the first response token. Per-response rows (log-probs,
weights) travel as padded ``(N, T_max)`` tensors inside the loop and are laid back onto the packed
layout (0 on prompt positions) only when a batch is built.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_darl.samples import Sample
from megatron_darl.trainer.batch import TrainBatch


def response_mask(samples: Sequence[Sample], t_max: int | None = None) -> torch.Tensor:
    """``(N, T_max)`` bool: True at each sample's real response tokens."""
    lengths = torch.tensor([s.num_tokens for s in samples], dtype=torch.int64)  # (N,)
    width = int(lengths.max()) if t_max is None and len(samples) else (t_max or 0)
    return torch.arange(width)[None, :] < lengths[:, None]


def pad_rows(rows: Sequence[torch.Tensor], t_max: int, fill: float = 0.0) -> torch.Tensor:
    """Stack ``(T_i,)`` rows into ``(N, t_max)`` float32, ``fill`` past each row's end."""
    out = torch.full((len(rows), t_max), fill, dtype=torch.float32)
    for n, row in enumerate(rows):
        out[n, : row.shape[0]] = row.to(torch.float32)
    return out


def _check_prompt(sample: Sample) -> None:
    if sample.prompt_ids.shape[0] < 1:
        raise ValueError(
            f"sample {sample.sample_id} has an empty prompt: the trainer never scores a "
            "sequence's first token, so the first response token would be lost"
        )


def sequence_batch(
    samples: Sequence[Sample],
    token_rows: dict[str, torch.Tensor] | None = None,
    seq_fields: dict[str, torch.Tensor] | None = None,
) -> TrainBatch:
    """Pack samples into a ``TrainBatch`` scored on their response tokens.

    Args:
        samples: the N samples, in batch order.
        token_rows: name -> ``(N, T_max)`` per-response values; each becomes a token field that
            holds 0 on prompt positions and the row's values on the response positions.
        seq_fields: name -> ``(N,)`` per-sample values (e.g. advantages).
    """
    if not samples:
        raise ValueError("cannot build a TrainBatch from zero samples")
    tokens, masks = [], []
    fields: dict[str, list[torch.Tensor]] = {name: [] for name in token_rows or {}}
    for n, s in enumerate(samples):
        _check_prompt(s)
        p, t = s.prompt_ids.shape[0], s.num_tokens
        tokens.append(torch.cat([s.prompt_ids.long(), s.response_ids.long()]))
        masks.append(torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(t, dtype=torch.bool)]))
        for name, rows in (token_rows or {}).items():
            fields[name].append(torch.cat([torch.zeros(p), rows[n, :t].float()]))
    return TrainBatch.from_sequences(tokens, masks, token_fields=fields or None,
                                     seq_fields=seq_fields)


def response_rows(batch: TrainBatch, samples: Sequence[Sample], flat: torch.Tensor) -> list[torch.Tensor]:
    """Cut a ``(T,)`` tensor aligned with ``batch.input_ids`` into each sample's ``(T_i,)`` response.

    ``batch`` must come from ``sequence_batch(samples)``: the inverse of its layout.
    """
    if flat.shape != (batch.num_tokens,):
        raise ValueError(f"expected ({batch.num_tokens},) values for the batch, got {tuple(flat.shape)}")
    out = []
    for s, seq in zip(samples, batch.split_by_sequence(flat), strict=True):
        p = s.prompt_ids.shape[0]
        out.append(seq[p : p + s.num_tokens].float())
    return out
