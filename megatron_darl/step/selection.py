"""The two typed views of a shard's buffered groups in one step: the candidates a log-prob pass
scores, and the selection the step trains on.

``planner.py`` makes both; the backfill (``backfill.py``) reads a ``Selection`` and the wait
(``prefetch.py``) scores ``Candidates`` to predict one, so they stand below all three and the
imports run one way, from the planner down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_darl.replay import BufferEntry
from megatron_darl.samples import Sample


@dataclass
class Candidates:
    """The groups the log-prob pass scores, and where their samples sit in the packed layout."""

    entries: list[BufferEntry]  # selectable groups, in buffer order
    samples: list[Sample]  # their samples, flattened
    lengths: torch.Tensor  # (N,) int64 response tokens per sample
    group_index: torch.Tensor  # (N,) int64 position of each sample's group in ``entries``
    behavior: torch.Tensor  # (n,) float32 engine log-probs (the packed groups' rows end to end)
    logp_t: torch.Tensor | None = None  # (n,) log pi_t from the pass over them (None: no pass)


@dataclass
class Selection:
    """What this shard selected, and the per-version token counts to sum over DP."""

    entries: list[BufferEntry]  # chosen groups, best first
    versions: list[int]  # the window at t (same on every shard), ascending
    version_tokens: torch.Tensor  # (K,) float64 selected response tokens per window version
    scores: list[float]  # score of each chosen group (0.0 during warmup)

    @property
    def samples(self) -> list[Sample]:
        return [s for e in self.entries for s in e.group.samples]
