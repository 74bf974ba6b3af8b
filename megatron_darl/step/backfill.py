"""The mixture's log-prob rows of a step's selected samples, and the backfill of those it lacks.

The mixture weights of a selected sample read, for every version k of the batch V(S), a row of
its log-probs under pi_k: the conditional's k = v_i term the engine's (the true sampler), every
other term and the whole posterior over versions the trainer's (docs/algorithm.md, which
source each quantity reads). The posterior compares versions, so it reads the trainer's row of
the sample's own version too: with the engine's row there the engine/trainer mismatch (a KL,
positive on sampled tokens) adds up along the prefix and tips the posterior onto v_i.

Where a trainer row of version k comes from:

    k = t            the step's log-prob pass at t (the proximal rows), or the wait's
    k < t, computed  an earlier step's pass at k, the own version included when the sample
                     arrived while the trainer was still at v_i (``_keep_current_rows`` keeps it)
    k < t, missing   ``mis.backfill=snapshot``: a pass under the parameter snapshot of k (one per
                     version, only the samples lacking it; the wait computes them first when it
                     can, ``prefetch.py``); a version whose snapshot is gone falls back to
                     ``nearest``, with a warning
                     ``mis.backfill=nearest``: a copy of the sample's nearest exact trainer row,
                     never the engine's (for the own version that is usually the row of the
                     version it arrived at: the posterior then treats v_i as that version)

The own version's trainer row is read only where the posterior is (prefix form, two or more
versions with tokens), and costs one row per selected sample that did not arrive at its own
version; it is counted with the other rows (``rows_*``, ``backfill_*``) and on its own
(``backfill_own``), so D-ARL's step cost shows it.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import torch

from megatron_darl.algorithms import MixtureForm, VariantSpec, WeightRule
from megatron_darl.replay import LogProbCache
from megatron_darl.step.config import AlgorithmConfig
from megatron_darl.step.prefetch import LogProbFn, RowCounts, Work, entry_pieces, take
from megatron_darl.step.selection import Selection
from megatron_darl.step.stats import StepStats

log = logging.getLogger(__name__)


class BackfillShard(Protocol):
    """What ``backfill`` reads of a shard's planner (``planner.ShardPlanner``), and the one flag
    it sets: ``logged_nearest_own``, so the own-version copies of ``nearest`` are logged once."""

    spec: VariantSpec
    algorithm: AlgorithmConfig
    cache: LogProbCache
    counts: RowCounts  # the step's rows by where they came from
    own_trainer_rows: bool  # the posterior reads the trainer's row of a sample's own version
    logged_nearest_own: bool

    def compute_rows(self, work: Work, logprobs: LogProbFn, stats: StepStats) -> None: ...


def posterior_reads_trainer(spec: VariantSpec, form: str) -> bool:
    """Whether the variant's weights read the trainer's row of a sample's own version: the
    prefix mixture's posterior does (the token form and the own-behavior weight do not)."""
    return spec.weight_rule is WeightRule.MIXTURE and MixtureForm(form) is MixtureForm.PREFIX


def mixture_versions(sel: Selection, global_tokens: torch.Tensor) -> list[int]:
    """V(S): the window versions with tokens in the selection over every DP shard."""
    return [v for v, n in zip(sel.versions, global_tokens.tolist()) if n > 0]


def backfill(planner: BackfillShard, sel: Selection, global_tokens: torch.Tensor, step: int,
             logprobs: LogProbFn, exact: set[int], stats: StepStats) -> None:
    """Rows of V(S) the selected samples lack (module docstring): exact where ``logprobs`` can
    score the version (one pass per version), else copied from the nearest trainer row. Rows
    already there (the engine's, earlier passes', the wait's) count as reused."""
    if planner.spec.weight_rule is not WeightRule.MIXTURE:
        return
    need = mixture_versions(sel, global_tokens)
    trainer = planner.own_trainer_rows and len(need) > 1  # the posterior reads the own version's
    cache, counts = planner.cache, planner.counts
    behavior = {s.sample_id: s.behavior_version for s in sel.samples if s.num_tokens}
    ids = list(behavior)
    read = len(ids) * (len(need) + int(trainer))  # with the engine's own row beside the trainer's
    counts.reused += read - len(cache.missing(ids, need, trainer))
    for v in need:
        if v not in exact:
            continue
        lacks = lambda s, v=v: not cache.has(s.sample_id, v, trainer)  # noqa: E731
        work = take(entry_pieces(sel.entries, lacks), math.inf, v)
        if work is not None:
            planner.compute_rows(work, logprobs, stats)
            counts.computed += len(work.samples)
            stats.backfill_snapshot += len(work.samples)
            stats.backfill_own += sum(1 for s in work.samples if s.behavior_version == v)
    gaps = cache.missing(ids, need, trainer)
    if not gaps:
        return
    stats.backfill_nearest += cache.backfill_nearest(gaps)
    own_gaps = sum(1 for sid, v in gaps if behavior[sid] == v)
    stats.backfill_own += own_gaps
    if planner.algorithm.mis.backfill == "snapshot":
        log.warning("step %d: %d log-prob rows of versions %s approximated by the nearest cached "
                    "trainer row (exact versions: %s)", step, len(gaps), sorted({v for _, v in gaps}),
                    sorted(exact))
    elif own_gaps and not planner.logged_nearest_own:
        planner.logged_nearest_own = True
        log.info("mis.backfill=nearest: the mixture's posterior reads a copy of each sample's nearest "
                 "trainer row for its own version (%d rows at step %d), not the engine's row: counted "
                 "in backfill_own and backfill_nearest", own_gaps, step)
