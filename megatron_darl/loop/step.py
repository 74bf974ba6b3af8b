"""One trainer step of the algorithm, between receiving groups and publishing the new weights.

``StepRunner.run(groups, step)`` is receive -> log-prob pass -> score -> select -> backfill ->
train (M x epochs PPO mini-batches, one new version) -> snapshot. It needs a trainer, the shard's
planner and the DP group, but no transport, so a test can drive the real loop step with groups
of its own (``tests/distributed/test_loop_resume_backfill.py``) and the trainer loop only adds
receiving, publishing, eviction and logging around it.

Backfill (DESIGN 4.3 c): rows of V(S) a selected sample lacks are recomputed from the parameter
snapshots of the last K versions (``mis.backfill=snapshot``, exact) or copied from the nearest
cached version (``nearest``). Every row filled either way is counted (``backfill_snapshot``,
``backfill_nearest``), and a nearest fallback under ``mis.backfill=snapshot`` (a version whose
snapshot is gone, e.g. after a resume from a checkpoint without snapshots) is logged as a warning.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from megatron_darl.algorithms import WeightRule
from megatron_darl.loop.config import AlgorithmConfig, ReplayConfig
from megatron_darl.loop.endpoints import dp_sum
from megatron_darl.loop.metrics import score_sums
from megatron_darl.loop.planner import Selection, ShardPlanner, loss_fn_for

log = logging.getLogger(__name__)


class StepClock:
    """Wall seconds of the parts of one step, each since the previous lap (``*_seconds`` metrics)."""

    def __init__(self, **laps: float) -> None:
        self.laps: dict[str, float] = dict(laps)
        self._last = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now


def uses_snapshots(algorithm: AlgorithmConfig) -> bool:
    """Whether the trainer keeps parameter snapshots: a mixture with exact backfill."""
    return (algorithm.spec().weight_rule is WeightRule.MIXTURE
            and algorithm.mis.backfill == "snapshot")


class StepRunner:
    """The algorithm part of one trainer step for one rank (its DP shard's planner)."""

    def __init__(self, algorithm: AlgorithmConfig, replay: ReplayConfig, planner: ShardPlanner,
                 trainer, ps) -> None:
        self.algorithm, self.replay = algorithm, replay
        self.planner, self.trainer, self.ps = planner, trainer, ps
        self.loss_fn = loss_fn_for(algorithm.eps_low, algorithm.eps_high)
        self.use_snapshots = uses_snapshots(algorithm)

    def run(self, groups, step: int, clock: StepClock | None = None) -> tuple[dict[str, Any], Any]:
        """Train on this step's new ``groups``; returns (metric sums, the trainer's StepResult).

        The trainer ends one version further, snapshotted when snapshots are kept. Eviction is
        left to the caller (after publishing), as are the DP reductions of the sums. ``clock``
        gets the ``logprob``, ``plan``, ``backfill`` and ``train`` laps.
        """
        clock = clock or StepClock()
        p, trainer, t = self.planner, self.trainer, self.trainer.version
        sums: dict[str, Any] = dict(p.receive(groups, step, t))
        cand, scores = p.candidate_batch(), {}
        sums.update(mismatch_k3_sum=0.0, mismatch_tokens=0.0)  # same keys on an empty shard
        if cand is not None:
            if p.needs_pass:
                sums.update(p.store_logprobs(cand, trainer.compute_logprobs(cand.batch), t))
            scores = p.score(cand, step)
        clock.lap("logprob_seconds")
        sums.update(score_sums(scores))
        sel = p.select(step, scores, t)
        sums.update(p.selection_sums(sel, t))
        tokens = dp_sum(sel.version_tokens.clone(), self.ps)
        clock.lap("plan_seconds")
        sums.update(self.backfill(sel, tokens, step))
        tb = p.training_batch(sel, tokens, t)
        clock.lap("backfill_seconds")
        result = trainer.train_steps(tb.minibatches, self.loss_fn)
        sums.update(tb.sums)
        if self.use_snapshots:
            trainer.snapshot(keep_last=self.replay.k)
        clock.lap("train_seconds")
        return sums, result

    def backfill(self, sel: Selection, tokens, step: int) -> dict[str, float]:
        """Rows of V(S) the selected samples lack: from snapshots (exact), else the nearest."""
        p, trainer = self.planner, self.trainer
        need = p.mixture_versions(sel, tokens)
        kept = set(trainer.snapshots.versions) | {trainer.version} if self.use_snapshots else set()
        exact = 0
        for v in need:
            todo = p.backfill_batch(sel, v) if v in kept else None
            if todo is not None:
                batch, samples = todo
                exact += p.store_backfill(batch, samples, trainer.compute_logprobs(batch, version=v), v)
        near = 0
        gaps = p.missing_rows(sel, need)
        if gaps:
            near = p.backfill_nearest(sel, need)
            if self.algorithm.mis.backfill == "snapshot":
                log.warning("step %d: %d log-prob rows of versions %s approximated by the nearest "
                            "cached version (snapshots kept: %s)", step, near,
                            sorted({v for _, v in gaps}), sorted(kept))
        return {"backfill_snapshot": float(exact), "backfill_nearest": float(near)}
