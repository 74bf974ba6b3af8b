"""One trainer step of the algorithm between receiving groups and publishing: plan, then train.

``StepRunner.plan(groups, step)`` is the shard's ``ShardPlanner.step`` (log-prob pass, score,
select, backfill, loss inputs, mini-batches) with the trainer as its log-prob source;
``StepRunner.train(plan)`` runs the mini-batches (M x epochs optimizer steps, one new version) and
keeps the parameter snapshot of that version. The planner, with the replay state, exists on the
replica's hub rank only: there ``plan`` announces each trainer call to the TP/PP peers
(``replica.py``), and on a peer ``plan`` serves those calls and returns the hub's mini-batches, so
``TrainerLoop.step`` reads the same on every rank. It needs a trainer, the planner and the
process groups, but no transport, so a test can drive the real step with groups of its own
(``tests/distributed/test_loop_resume_backfill.py``); ``TrainerLoop.step`` adds receiving,
publishing, eviction and logging around it.

Backfill (docs/algorithm.md, section 7): rows of V(S) a selected sample lacks are recomputed from
the parameter snapshots of the window (``mis.backfill=snapshot``, exact) or copied from the nearest
cached version (``nearest``); both are counted (``backfill_snapshot``, ``backfill_nearest``), and a
nearest fallback under ``snapshot`` (a version whose snapshot is gone, e.g. after a resume from a
checkpoint without snapshots) is logged as a warning.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from megatron_darl.algorithms import PolicyLossInputs, RegularizedLossInputs, WeightRule, policy_loss
from megatron_darl.step.config import AlgorithmConfig, ReplayConfig
from megatron_darl.step.planner import ShardPlanner, StepPlan
from megatron_darl.step.regularize import LOSS_STATS, ReferenceRows, keep_versions, regularized_loss_fn, terms_on
from megatron_darl.step.replica import Op, ReplicaLink
from megatron_darl.samples import SampleGroup
from megatron_darl.trainer.batch import TrainBatch


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


def loss_fn_for(eps_low: float, eps_high: float):
    """The trainer's ``loss_fn(logp (n,), batch_slice) -> (loss_sum, stats)`` around ``policy_loss``.

    ``logp`` and the slice's ``PolicyLossInputs`` are both in the packed layout of the slice's
    scored tokens, so the loss is one call over ``(n,)`` tensors; ``num_tokens=1`` makes it the
    micro-batch's loss *sum* (the trainer divides by the step's tokens).
    """
    def loss_fn(logp: torch.Tensor, batch_slice: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        x: PolicyLossInputs = batch_slice.loss_inputs
        loss, stats = policy_loss(logp, x.logp_base, x.weights, x.advantages, None, eps_low, eps_high,
                                  num_tokens=1.0)
        return loss, {k: float(getattr(stats, k)) for k in LOSS_STATS}

    return loss_fn


class StepRunner:
    """The algorithm part of one trainer step for one rank; ``planner`` on the hub rank only."""

    def __init__(self, algorithm: AlgorithmConfig, replay: ReplayConfig, planner: ShardPlanner | None,
                 trainer, ps) -> None:
        self.terms = terms_on(algorithm)  # entropy / KL in the loss (``regularize.py``); off: the plain loss
        self.link = ReplicaLink(ps, RegularizedLossInputs if self.terms else PolicyLossInputs)
        if (planner is not None) != self.link.is_hub:
            raise ValueError(f"rank {ps.rank} (tp {ps.tp_rank}, pp {ps.pp_rank}): the replica's hub "
                             "rank, and only it, holds the planner")
        self.algorithm, self.window = algorithm, replay.window
        self.planner, self.trainer, self.ps = planner, trainer, ps
        self.loss_fn = (regularized_loss_fn(algorithm) if self.terms
                        else loss_fn_for(algorithm.eps_low, algorithm.eps_high))
        self.train_kwargs = {"entropy": True} if algorithm.entropy_coef > 0 else {}
        self.reference = ReferenceRows(algorithm) if self.terms and planner is not None else None
        self.logprobs = trainer.compute_logprobs  # (batch, version) -> (n,): the planner's pass
        self.use_snapshots = uses_snapshots(algorithm)
        self.prefetch_tokens = trainer.cfg.micro_batch.logprob_token_budget  # one pass of the wait
        self.prefetch_seconds = 0.0  # spent in the current wait's passes

    # ---- the wait for a step's groups: the rows it will need (``prefetch.py``) ----------------
    def prefetch(self, received: Sequence[SampleGroup], step: int) -> bool:
        """Hub, while waiting: one pass of rows step ``step`` will need; False when none is left."""
        start = time.monotonic()
        exact = self.trainer.snapshots.versions if self.use_snapshots else ()
        did = self.planner.prefetch(received, step, self.trainer.version, self.replica_logprobs, exact,
                                    self.prefetch_tokens)
        self.prefetch_seconds += time.monotonic() - start
        return did

    def end_wait(self, stopped: bool, fatal: bool) -> None:
        """Hub: the wait is over; the peers learn whether the step goes on."""
        self.link.announce(Op.WAITED, int(stopped) | int(fatal) << 1, [])

    def follow_wait(self) -> tuple[bool, bool]:
        """Peer: serve the hub's passes of the wait; (stopped, fatal) once it is over."""
        while True:
            op, arg = self.link.receive()
            if op is Op.LOGPROBS:
                self.logprobs(self.link.batch(), arg)
                continue
            assert op is Op.WAITED, f"expected the end of the wait, got {op!r}"
            return bool(arg & 1), bool(arg & 2)

    def take_prefetch_seconds(self) -> float:
        """Seconds the hub spent in the wait's passes since the last call."""
        seconds, self.prefetch_seconds = self.prefetch_seconds, 0.0
        return seconds

    def plan(self, groups: Sequence[SampleGroup], step: int, clock: StepClock | None = None) -> StepPlan:
        """Hub: this shard's plan of step ``step`` with its new ``groups`` (``logprob``, ``plan``
        and ``backfill`` laps on ``clock``). Peer: serve the hub's passes; its mini-batches."""
        if self.planner is None:
            return self._follow()
        trainer = self.trainer
        exact = trainer.snapshots.versions if self.use_snapshots else ()
        lap = (clock or StepClock()).lap
        plan = self.planner.step(groups, step, trainer.version, self.replica_logprobs, exact,
                                 dp_sum=self.ps.dp_sum, lap=lap)
        if self.reference is not None:
            plan = self.reference.attach(plan, self.planner, self.replica_logprobs)
            lap("reference_seconds")
        return plan

    def replica_logprobs(self, batch: TrainBatch, version: int) -> torch.Tensor:
        """Hub: a log-prob pass as the replica runs it: announced to the peers, then run."""
        self.link.announce(Op.LOGPROBS, version, [batch])
        return self.logprobs(batch, version)

    def _follow(self) -> StepPlan:
        """Peer: run each pass the hub announces, until it hands over the step's mini-batches."""
        while True:
            op, arg = self.link.receive()
            if op is Op.LOGPROBS:
                self.logprobs(self.link.batch(), arg)
                continue
            parts = [self.link.batch() for _ in range(self.algorithm.ppo_minibatches)]
            return StepPlan(parts * self.algorithm.ppo_epochs)

    def train(self, plan: StepPlan, clock: StepClock | None = None):
        """Run the plan's mini-batches (one new version) and snapshot it; the trainer's StepResult."""
        if self.planner is not None:
            self.link.announce(Op.TRAIN, 0, plan.minibatches[: self.algorithm.ppo_minibatches])
        result = self.trainer.train_steps(plan.minibatches, self.loss_fn, **self.train_kwargs)
        if self.use_snapshots:
            self.trainer.snapshot(keep=keep_versions(self.window.versions(self.trainer.version), self.algorithm))
        if clock is not None:
            clock.lap("train_seconds")
        return result

    def run(self, groups: Sequence[SampleGroup], step: int, clock: StepClock | None = None):
        """``plan`` then ``train``: (the plan, with its statistics, and the trainer's StepResult)."""
        plan = self.plan(groups, step, clock)
        return plan, self.train(plan, clock)
