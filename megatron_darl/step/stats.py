"""One DP shard's statistics of a trainer step, each field declaring how DP reduces it.

The planner fills a ``StepStats`` as the step goes (arrival, pass, selection, weights, backfill,
eviction); ``reduce`` turns the shard's values into global ones with one collective per
reduction kind (fields packed into one float64 vector per kind), whatever the DP size. Sums are
exact; the few maxima (``SUM``/``MAX`` in each field's metadata) are named here, not guessed from
a ``_max`` suffix. ``metrics.step_metrics`` turns the reduced values into the logged means.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor | None]  # in place (may return None) or the result
CACHE_SOURCES = ("engine", "trainer", "snapshot", "nearest")


class Reduction(str, enum.Enum):
    """How one statistic is combined over DP shards."""

    SUM = "sum"
    MAX = "max"


def _sum(default: float = 0.0):
    return field(default=default, metadata={"reduce": Reduction.SUM})


def _max(default: float):
    return field(default=default, metadata={"reduce": Reduction.MAX})


def _hist():
    return field(default_factory=lambda: torch.zeros(1, dtype=torch.float64), metadata={"reduce": Reduction.SUM})


@dataclass
class StepStats:
    """Per-shard sums (and maxima) of one step; every shard has the same fields and shapes."""

    # arrival
    groups_received: float = _sum()
    samples_received: float = _sum()
    reward_sum: float = _sum()
    response_tokens_received: float = _sum()
    dropped_stale: float = _sum()  # arrived already left of the window
    mixed_version_samples: float = _sum()  # tokens of several versions (interruptible rollout)
    staleness_hist: torch.Tensor = _hist()  # (bins,) groups by t - v at arrival, last bin: older
    # replay.fill_batch: groups of equal rewards the hub dropped on arrival while the step waited
    # (not in the sums above: never buffered; generated all the same)
    groups_degenerate: float = _sum()
    samples_degenerate: float = _sum()
    reward_sum_degenerate: float = _sum()
    response_tokens_degenerate: float = _sum()
    # log-prob pass: engine vs trainer at equal version (k3 estimate of KL)
    mismatch_k3_sum: float = _sum()
    mismatch_tokens: float = _sum()
    # the candidates and the log-prob passes at t (``candidates.py``)
    candidate_groups: float = _sum()  # eligible groups in the buffer
    groups_scored: float = _sum()  # groups in a log-prob pass at t (scoring or selected)
    logprob_passes: float = _sum()
    rescore_audits: float = _sum()  # replay.rescore_audit: what the rule would have selected
    rescore_agreement_sum: float = _sum()
    rescore_score_gap_sum: float = _sum()
    rescore_rule_scored: float = _sum()
    # log-prob rows (sample x version) the step needed, by where they came from (``prefetch.py``)
    rows_computed: float = _sum()  # on the critical path: the step's pass and backfill
    rows_prefetched: float = _sum()  # while the trainer waited for the step's groups
    rows_reused: float = _sum()  # already there: the wait's, an earlier step's, the engine's
    rows_duplicate: float = _sum()  # computed although they existed (must stay 0)
    prefetch_passes: float = _sum()  # passes made during the wait
    # scores of the candidates
    score_sum: float = _sum()
    score_count: float = _sum()
    score_max: float = _max(-math.inf)
    # selection
    groups_selected: float = _sum()
    samples_selected: float = _sum()
    tokens_selected: float = _sum()
    selected_score_sum: float = _sum()
    selected_hist: torch.Tensor = _hist()  # (bins,) selected groups by t - v
    selected_staleness_max: float = _max(-1.0)  # t - oldest selected version; -1: none selected
    times_selected_max: float = _max(0.0)  # most times a selected group has now been trained
    # backfill: rows filled exactly (snapshots) and approximately (nearest version)
    backfill_snapshot: float = _sum()
    backfill_nearest: float = _sum()
    backfill_own: float = _sum()  # of both: rows of a sample's own version (the posterior's, ``backfill.py``)
    ref_rows: float = _sum()  # KL term: reference (version 0) rows computed (``regularize.py``)
    # behavior weights of the selection
    w_sum: float = _sum()
    w_sq_sum: float = _sum()
    w_tokens: float = _sum()
    w_clipped: float = _sum()
    # the same split by the sign of the token's advantage: a cap that binds mostly on A > 0
    # tokens (a stale correct answer the policy has since learned) biases the update negative
    w_pos_sum: float = _sum()
    w_pos_tokens: float = _sum()
    w_pos_clipped: float = _sum()
    w_neg_sum: float = _sum()
    w_neg_tokens: float = _sum()
    w_neg_clipped: float = _sum()
    # eviction, at the end of the step
    groups_evicted: float = _sum()
    groups_untrained: float = _sum()  # selectable groups left in the buffer that were never trained
    rows_evicted: float = _sum()
    buffer_groups: float = _sum()
    cache_bytes: float = _sum()
    cache_rows_engine: float = _sum()
    cache_rows_trainer: float = _sum()
    cache_rows_snapshot: float = _sum()
    cache_rows_nearest: float = _sum()

    @classmethod
    def empty(cls, hist_bins: int) -> "StepStats":
        """Zero statistics with histograms of ``hist_bins`` bins."""
        zeros = lambda: torch.zeros(hist_bins, dtype=torch.float64)  # noqa: E731
        return cls(staleness_hist=zeros(), selected_hist=zeros())

    def reduce(self, allreduce_sum: Reduce, allreduce_max: Reduce) -> "StepStats":
        """The global statistics: one collective per reduction kind over the packed fields."""
        out = dataclasses.replace(self)
        for kind, op in ((Reduction.SUM, allreduce_sum), (Reduction.MAX, allreduce_max)):
            names = [f.name for f in dataclasses.fields(self) if f.metadata["reduce"] is kind]
            parts = [torch.as_tensor(getattr(self, n), dtype=torch.float64).reshape(-1) for n in names]
            flat = torch.cat(parts)
            reduced = op(flat)
            reduced = flat if reduced is None else reduced  # in-place collectives return None
            for name, piece in zip(names, torch.split(reduced, [p.numel() for p in parts])):
                setattr(out, name, piece.clone() if torch.is_tensor(getattr(self, name)) else float(piece))
        return out

    def as_dict(self) -> dict[str, float | torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
