"""The trainer-side D-ARL loop: receive -> plan -> train -> publish -> evict, one weight version
per iteration (M x epochs PPO mini-batch optimizer steps); synchronous training is the same loop
with eta = 0 and K = 1 (``configs/algorithm/sync.yaml``).

A step starts once the hubs hold the step's B new groups; groups beyond that count for the next
steps (``endpoints.Backlog``). With ``replay.fill_batch`` those are B trainable groups: the hubs
drop degenerate ones on arrival and give their starts back (``endpoints.receive_groups``).

Every trainer rank runs this. The algorithm lives in ``ShardPlanner.step`` (one per DP shard, on
the shard's hub rank only, with the replay buffer and log-prob cache; its TP/PP peers get each
step's batches by broadcast: ``replica.py``) and ``step.StepRunner`` (plan and train with the
trainer); the transport ends in
``endpoints``; the checkpoints are ``checkpoint.manager.CheckpointManager``; metrics are reduced over
DP and written by rank 0. SIGTERM, SIGINT or SIGUSR1
finish the current step, write a checkpoint (model, optimizer, RNG, step, version, each shard's
buffer and cache, and the parameter snapshots of the window when the variant backfills from
them) and exit 0; ``loop.resume`` continues from the latest one.

When the rollout side fails for good (no group for ``loop.receive_timeout_s``, every worker
lost, or a weight sync that no worker could take) the rank that saw it says why, every rank
agrees on it at the next step boundary, the run checkpoints the same way and ``run`` raises
``RunAborted`` with that one line: the run's work is kept and the exit is non-zero.

Failures that leave no chance to checkpoint are covered by checkpoints between steps
(``checkpoint.manager.CheckpointManager``: by default once the time since the last one reaches about
67 times a save's duration, ``loop.checkpoint_overhead``): a killed or frozen trainer rank (every rank is
watched, ``endpoints``), or a loss, gradient norm or weight norm gone NaN/Inf, whose weights
are neither published nor checkpointed (``trainer.weight_check``; a save refuses them too). Either way the line names the newest checkpoint to resume from.
"""

from __future__ import annotations

import datetime
import logging
import math
import signal
import time
from dataclasses import asdict
from typing import Any, Callable, Sequence

import torch

from megatron_darl import timeline
from megatron_darl.checkpoint.manager import CheckpointManager, newest_checkpoint
from megatron_darl.eval.periodic import planned
from megatron_darl.exit_codes import ExitCode
from megatron_darl.loop.heldout_eval import HeldoutRequests
from megatron_darl.loop.endpoints import (
    Backlog, Received, TrainerEndpoints, open_endpoints, publish_weights, receive_groups,
    wait_for_workers, worker_health,
)
from megatron_darl.loop.gc_clock import GcClock
from megatron_darl.loop.metrics import MetricsLogger, WorkerRates, step_metrics
from megatron_darl.loop.resume import mark_ready, seed_store
from megatron_darl.loop.run_config import RunConfig
from megatron_darl.loop.stop_request import RequestWatch
from megatron_darl.samples import SampleGroup
from megatron_darl.step.planner import ShardPlanner
from megatron_darl.step.regularize import ensure_reference, keep_versions, term_stats
from megatron_darl.step.runner import StepClock, StepRunner, uses_snapshots
from megatron_darl.step.stats import StepStats
from megatron_darl.trainer.parallel import ParallelState
from megatron_darl.trainer.policy_trainer import PolicyTrainer, StepResult, compiled_frames
from megatron_darl.transport import (
    TRAINER, WORKER, SyncReport, TransportTimeout, WeightSyncFailed, request_stop, wait_for_exits,
)
from megatron_darl.transport.staleness import bound_filled

log = logging.getLogger(__name__)


class RunAborted(RuntimeError):
    """The trainer gave up after writing a checkpoint; the message is the one line saying why."""


class _StopFlag:
    """SIGTERM/SIGINT/SIGUSR1 set a flag; the loop checkpoints at the end of the current step.
    SIGUSR1 is what ``sbatch --signal=USR1@<seconds>`` sends ahead of a time limit or preemption.

    ``arm`` installs the handlers again, and the loop arms at every step boundary: a native
    library in the process can take a signal over below Python, which then never sees it. A
    compile on a fresh cache does so on a GPU host: SIGUSR1 is then caught together with SIGHUP,
    SIGQUIT, SIGUSR2, SIGXCPU, SIGXFSZ and SIGSYS, a set Python never installs (LLVM, inside
    Triton, registers such a set), and a handler that passes nothing on would swallow Slurm's USR1.
    A signal swallowed in between is not lost: who forwards it also writes it into the run dir's
    stop request (``stop_request.py``), which rank 0 reads through ``watch``."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, watch: RequestWatch | None = None) -> None:
        self.signum: int | None = None
        self.watch = watch or RequestWatch(None)  # None: no request file looked at (ranks but 0)
        self.arm()

    def requested(self, now: bool = False) -> int | None:
        """The stop signal, from a handler or the request file (read ``now``, else at most once
        per ``watch.every_s``)."""
        if self.signum is None:
            self.signum = self.watch.check() if now else self.watch.poll()
        return self.signum

    def arm(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._set)

    def _set(self, signum: int, frame) -> None:  # noqa: ARG002 (signal API)
        log.warning("signal %d: checkpointing after this step", signum)
        self.signum = signum


class TrainerLoop:
    """One trainer rank's run; ``run()`` returns the process exit code."""

    def __init__(self, cfg: RunConfig, trainer: PolicyTrainer, ps: ParallelState, endpoints: TrainerEndpoints,
                 run_config: dict[str, Any] | None = None) -> None:
        self.cfg, self.trainer, self.ps, self.ep = cfg, trainer, ps, endpoints
        self.planner = (ShardPlanner(cfg.algorithm, cfg.replay, shard=ps.dp_rank, num_shards=ps.dp_size,
                                     num_workers=cfg.topology.workers)
                        if self.ps.is_hub else None)
        self.runner = StepRunner(cfg.algorithm, cfg.replay, self.planner, trainer, ps)
        self.use_snapshots = uses_snapshots(cfg.algorithm)
        self.kl_reference = cfg.algorithm.kl_coef > 0  # the initial weights stay as snapshot v0
        self.checkpoints = CheckpointManager(cfg.loop, trainer, ps, self.use_snapshots or self.kl_reference,
                                             self._extra_state)
        workers = cfg.topology.workers
        self.base_received, self.received = 0, 0  # groups: restored global total, local since
        self.backlog = Backlog(cfg.algorithm.groups_per_step,  # hubs: groups beyond B for the next steps
                               ahead=cfg.algorithm.max_staleness if cfg.loop.wait_for_bound else 0)
        self.base_made = torch.zeros(workers, dtype=torch.int64)  # per worker groups received
        self.made = torch.zeros(workers, dtype=torch.int64)
        self.step_groups = torch.zeros(workers, dtype=torch.int64)  # per worker groups received this step
        self.start_step = self._maybe_resume()
        self.logger = MetricsLogger(cfg.loop, run_config, self.start_step) if ps.rank == 0 else None
        self.heldout = (HeldoutRequests(cfg.eval, cfg.loop.steps, endpoints.store, self.logger.heldout_versions)
                        if ps.rank == 0 and planned(cfg.eval, cfg.data) else None)  # rank 0: held-out points
        if ps.rank == 0:
            if self.start_step > 0:
                seed_store(endpoints.store, self.base_received, self.base_made.tolist())
            self._request_heldout()  # the version the workers start from (before they may load it)
            mark_ready(endpoints.store)
        self.stop = _StopFlag(RequestWatch(cfg.loop.run_dir if ps.rank == 0 else None))
        # the stop agreement's group: a rank may wait there for a stage leader's last publish
        # (``_finish_publish``), so its bound is a collective's plus a publish's (gloo's own: 30 min)
        bound = datetime.timedelta(seconds=cfg.parallel.timeout_s + cfg.transport.weight_sync.publish_bound_s)
        self._world_gloo = torch.distributed.new_group(backend="gloo", timeout=bound) if ps.world_size > 1 else None
        self.sync: SyncReport | None = None  # the last weight sync that finished (stage leaders)
        self.fatal = ""  # why this rank saw the run fail for good (transport), "" while it can go on
        self.diverged = False  # the weights went NaN/Inf: no checkpoint may be written of them
        self._save_due = False  # agreed at the last step boundary: checkpoint before the next step
        self._stop_deadline = False  # agreed there too: the stop signal ends in SIGKILL (scancel)
        self._rates = WorkerRates(workers)  # rank 0: per-worker rollout metrics
        self.gc = GcClock()  # this rank's collections, per step

    # ---- checkpoints: the loop's own state in them ------------------------------------------
    def _maybe_resume(self) -> int:
        """The step to start at: 0, or the resumed checkpoint's (the hub restores its planner and
        the group counts; every rank learns the step from it)."""
        loaded = self.checkpoints.load()
        if loaded is None:
            return 0
        path, resumed = loaded
        step = -1
        if self.ps.is_hub:
            extra = resumed.extra_states[self.ps.dp_rank]
            self.planner.load_state_dict(extra["planner"])
            self.base_received = int(extra["groups_received"])
            self.base_made = torch.as_tensor(extra["worker_groups"], dtype=torch.int64)
            step = int(extra["step"])
            self.backlog.surplus = int(extra.get("backlog_surplus",  # absent in an older checkpoint
                                                 max(0, self.base_received - step * self.cfg.algorithm.groups_per_step)))
        step = self.runner.link.share(step)
        timeline.mark("checkpoint_loaded")  # its own phase: the load is no trainer compile
        log.info("resumed from %s at step %d, version %d", path, step, resumed.version)
        return step

    def _extra_state(self, next_step: int) -> dict[str, Any] | None:
        """What a checkpoint before ``next_step`` keeps of the loop: on a hub its shard's planner
        (buffer, cache) and the run's group counts (collective over DP: every rank calls it)."""
        received = self.base_received + int(self.ps.dp_sum(torch.tensor([self.received])))
        made = torch.maximum(self.base_made, self.ps.dp_max(self.made.clone()))
        return None if self.planner is None else {
            "planner": self.planner.state_dict(), "step": next_step,
            "groups_received": received, "worker_groups": made.tolist(), "backlog_surplus": self.backlog.surplus}

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        """Train to ``loop.steps`` (0); raises ``RunAborted`` after the checkpoint when it gave up."""
        if self.use_snapshots:
            self.trainer.snapshot(keep=keep_versions(self.runner.window.versions(self.trainer.version),
                                                      self.cfg.algorithm))
        if self.kl_reference:
            ensure_reference(self.trainer, only=not self.use_snapshots)
        self._warm_up()
        step, saved = self.start_step, None
        try:
            if step > 0:  # a resumed run: fresh workers must get the resumed weights first
                wait_for_workers(self.ep, self.ps, self.cfg.topology.workers,
                                 self.cfg.loop.receive_timeout_s, tag=step)
                self._publish()
            while step < self.cfg.loop.steps and not self._stop_agreed(step):
                if self._save_due:
                    self.checkpoints.save_between(step)
                    self._milestone("first_checkpoint")
                self.ep.heartbeat.step = step
                if not self.step(step):
                    break
                if step == self.start_step:
                    self._milestone("first_step")
                step += 1
            # the checkpoint first: the last publish can hang on a worker that died mid-transfer
            # (a blocked collective until the transfer timeout), past a stop signal's grace, and
            # what the workers hold is no part of it (a resumed run publishes again)
            # NaN weights are never checkpointed: the newest one stays the last good; a run that
            # finished its steps skips the final one only with loop.save_at_end=false (benchmarks)
            finished = step >= self.cfg.loop.steps and not self.fatal
            if not self.diverged and (self.cfg.loop.save_at_end or not finished):
                self._stop_agreed(step)  # a signal that cut the last receive: agree its deadline too
                saved = self.checkpoints.save(step, deadline=self._stop_deadline)
            self.stop.watch.done()  # a stop request was for this launch, which ends here (rank 0)
            self._finish_publish()
            self._stop_agreed(step)  # a failure in the last step's publish: every rank learns it
        finally:
            self._shutdown(step)
        if self.fatal:
            raise RunAborted(self.fatal if self.diverged else f"{self.fatal}; checkpoint {saved} written")
        return ExitCode.OK

    def _warm_up(self) -> None:
        """Compile the trainer's kernels on a synthetic batch the size of a response before the
        first wait (``PolicyTrainer.warm_up``): it overlaps the engines' start instead of
        sitting in the first step."""
        new = self.cfg.sampling.max_new_tokens
        timeline.mark("warm_up_start")  # after the resume and the snapshots: the compile alone
        seconds = self.trainer.warm_up([new + 256, new // 2 + 64], **self.runner.train_kwargs)
        timeline.mark("warmed_up")
        if seconds and self.ps.rank == 0:
            log.info("trainer kernels compiled in %.1f s before the first step", seconds)

    def _milestone(self, event: str) -> None:
        """Mark a launch milestone; rank 0 writes the launch timeline (``timeline.py``) and, at the
        first step, logs it in one line."""
        timeline.mark(event)
        if self.ps.rank != 0:
            return
        phases = timeline.summarize(self.cfg.loop.run_dir)
        if event == "first_step" and phases:
            log.info("%s", timeline.describe(phases))

    def _stop_agreed(self, step: int) -> bool:
        """True on every trainer rank when any rank got the signal or gave up: ranks that saw it
        a moment apart must still leave the loop at the same step (a rank alone would hang the
        others' collectives). One tiny gloo all-reduce per step; on a failure every rank takes
        the first rank's reason (one more collective, once). The same all-reduce carries rank 0's
        verdict on a checkpoint before ``step`` (``_save_due``: every rank saves, or none), and
        whether any rank's signal has a deadline (``_stop_deadline``: SIGTERM or SIGINT, which
        Slurm follows with SIGKILL after ``KillWait``; SIGUSR1 has none)."""
        self.stop.arm()  # a kernel compiled in the last step may have taken the signals over
        due = self.checkpoints.due(step, self.start_step)
        signum = self.stop.requested(now=True)  # once: a signal between two reads would stop without its deadline
        deadline = signum in (signal.SIGTERM, signal.SIGINT)
        flag = torch.tensor([int(signum is not None), int(bool(self.fatal)), int(due), int(deadline)],
                            dtype=torch.int64)
        if self.ps.world_size > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._world_gloo)
        if int(flag[1]) and self.ps.world_size > 1:
            reasons: list[str] = [""] * self.ps.world_size
            torch.distributed.all_gather_object(reasons, self.fatal, group=self._world_gloo)
            self.fatal = next(r for r in reasons if r)
        self._save_due = bool(flag[2])
        self._stop_deadline = bool(flag[3])
        return bool(flag[:2].any())

    def _publish(self) -> None:
        """Send the current version to the rollout workers; a sync no worker could take is fatal."""
        try:
            self.sync = publish_weights(self.ep, self.trainer, self.ps) or self.sync
        except (WeightSyncFailed, TransportTimeout) as exc:
            self.fatal = f"trainer rank {self.ps.rank}: {exc}"
            log.error("%s", self.fatal)

    def _finish_publish(self) -> None:
        """Wait for a background publish in flight (the last version reaches the workers)."""
        if self.ep.publisher is None:
            return
        try:
            self.sync = self.ep.publisher.wait() or self.sync
        except (WeightSyncFailed, TransportTimeout) as exc:
            self.fatal = self.fatal or f"trainer rank {self.ps.rank}: {exc}"
            log.error("%s", self.fatal)

    def step(self, step: int) -> bool:
        """One trainer step: receive -> plan -> train -> publish -> evict. False when a signal or
        a failure cut the receive (no step was made)."""
        start, t = time.monotonic(), self.trainer.version
        groups = self._receive(step)
        if groups is None:
            return False
        if step == self.start_step:
            timeline.mark("first_groups")
        prefetch = self.runner.take_prefetch_seconds()  # work done while waiting is not idle
        clock = StepClock(receive_wait_seconds=time.monotonic() - start - prefetch, prefetch_seconds=prefetch)
        plan = self.runner.plan(groups, step, clock)  # TP/PP peers: the hub's mini-batches
        result = self.runner.train(plan, clock)
        if self._diverged(step, result):
            return False
        self._request_heldout()  # before the publish: the worker checks as it loads the version
        self._publish()
        clock.lap("publish_seconds")
        if self.planner is not None:  # the hub: end the step, log it
            self.planner.evict(self.trainer.version, plan.stats)
            reduced = plan.stats.reduce(self.ps.dp_sum, self.ps.dp_max)
            self.backlog.keep_at_most(int(reduced.groups_untrained))  # a group that expired untrained
            self._log(step, t, reduced, result, clock.laps, time.monotonic() - start)
        if self.heldout is not None:
            for point in self.heldout.poll():
                self.logger.log_heldout(point)
        return True

    def _request_heldout(self) -> None:
        """Rank 0: ask the evaluating worker for the current version when it is due
        (``loop.heldout_eval``: never waits here)."""
        if self.heldout is not None:
            self.heldout.request(self.trainer.version)

    def _diverged(self, step: int, result: StepResult) -> bool:
        """A loss, gradient norm or weight norm that is NaN/Inf stops the run before the weights it
        produced are published or checkpointed (the same numbers on every rank: all ranks stop
        here). The weights themselves are checked too: an update with a finite loss and gradient
        can still write NaN into them (Adam with ``eps=0`` on a zero gradient)."""
        clipped = self.cfg.trainer.optimizer.clip_grad > 0  # else Megatron computes no norm (NaN stands in)
        bad = [f"{name} {value}" for name, value, on in (("loss", result.loss, True),
                                                          ("gradient norm", result.grad_norm, clipped),
                                                          ("weight norm", result.weight_norm, True))
               if on and not math.isfinite(value)]
        if not bad:
            return False
        self.diverged = True
        self.fatal = (f"trainer step {step}: {' and '.join(bad)}: the weights of version {self.trainer.version} "
                      f"are not trustworthy, so they were neither published nor checkpointed; "
                      f"{self.checkpoints.newest()}")
        log.error("%s", self.fatal)
        return True

    def _receive(self, step: int) -> list[SampleGroup] | None:
        """This replica's new groups of ``step``, or None when a signal or a failure cut the wait
        (a background weight sync that failed cuts it too, and is the cause named). While the
        hub waits it computes the rows the step will need (``replay.prefetch``); its TP/PP peers
        take part in those passes."""
        received = self._wait(step) if self.ps.is_hub else self._follow_wait(step)
        if received.stopped or received.fatal:
            publisher = self.ep.publisher
            failed = publisher.failure(wait_s=5.0 if received.fatal else 0.0) if publisher is not None else None
            self.fatal = f"trainer rank {self.ps.rank}: {failed}" if failed is not None else received.fatal
            if self.fatal:
                log.error("%s", self.fatal)
            return None
        self.backlog.took(received.total)
        self._count(received.groups)
        if self.planner is not None and received.degenerate:
            self.planner.dropped_degenerate(received.degenerate)  # the step's metrics
            self._count(received.degenerate, made_only=True)
        return received.groups

    def _wait(self, step: int) -> Received:
        """Hub: poll until the step's groups are in, prefetching between polls; then tell the peers."""
        publisher, prefetch = self.ep.publisher, self.cfg.replay.prefetch
        received = receive_groups(self.ep, self.ps, self.backlog.need(), self.cfg.loop.receive_timeout_s, step,
                                  self.cfg.transport.control.poll_interval_s,
                                  self.cfg.topology.workers,
                                  stop=lambda: self.stop.requested() is not None or (
                                      publisher is not None and publisher.failure() is not None),
                                  idle=lambda groups: prefetch and self.runner.prefetch(groups, step),
                                  max_degenerate=self.cfg.replay.max_degenerate(self.cfg.algorithm.groups_per_step),
                                  filled=self._bound_filled() if self.cfg.loop.wait_for_bound else None,
                                  floor=self.backlog.floor())
        self.runner.end_wait(received.stopped, bool(received.fatal))
        return received

    def _bound_filled(self) -> Callable[[], bool]:
        """Rank 0's check that no more starts can reach the hubs under the bound now."""
        bound, version = self.cfg.bound, self.trainer.version
        return lambda: bound_filled(self.ep.store, bound, version)

    def _follow_wait(self, step: int) -> Received:
        """Peer: serve the hub's passes until the wait is over; whether the step goes on."""
        stopped, fatal = self.runner.follow_wait()
        why = f"trainer step {step}: the replica's hub gave up waiting for groups" if fatal else ""
        return Received(stopped=stopped, fatal=why)

    def _count(self, groups: Sequence[SampleGroup], made_only: bool = False) -> None:
        """Received groups, and per worker how many it made (a group carries its ordinal among
        its worker's groups: ``SampleGroup.worker_index``); ``made_only``: groups dropped on
        arrival (``replay.fill_batch``), which count only there (a resume continues after them)."""
        for g in groups:
            self.made[g.worker_id] = max(int(self.made[g.worker_id]), g.worker_index + 1)
        if made_only:
            return
        self.received += len(groups)
        for g in groups:
            self.step_groups[g.worker_id] += 1

    def _log(self, step: int, t: int, reduced: StepStats, result: StepResult, laps: dict[str, float],
             wall_s: float) -> None:
        """Rank 0 logs the step from the DP-reduced ``reduced``; every hub takes part in the sums."""
        per_worker, self.step_groups = self.ps.dp_sum(self.step_groups), torch.zeros_like(self.step_groups)
        # every hub: torch.compile frames so far, and its garbage collector's seconds and full collections
        compiles, gc_seconds, gc_full = self.ps.dp_max(torch.tensor([float(compiled_frames()), *self.gc.take()],
                                                                     dtype=torch.float64)).tolist()
        if self.logger is None:
            return
        gen_s = max(wall_s, 1e-9)  # groups arrive at the pace of generation in steady state
        self.ep.heartbeat.refresh(self.ep.store)  # the counters posted before the groups just trained
        trainer = {
            "loss": result.loss, "grad_norm": result.grad_norm, "weight_norm": result.weight_norm, "lr": result.lr,
            "trainer_tokens_per_s": result.tokens_per_s, "mfu": result.mfu,
            "rollout_tokens_per_s": (reduced.response_tokens_received + reduced.response_tokens_degenerate) / gen_s,
            "step_seconds": wall_s, **self._sync_metrics(), **laps,
            **self._rates.step(lambda w: self.ep.heartbeat.peer_stats(WORKER, w)),
            "version": float(self.trainer.version),
            "optimizer_steps": float(result.optimizer_steps),
            "dynamo_compiles": compiles,  # torch.compile frames so far: flat after the first step
            "gc_seconds": gc_seconds, "gc_full_collections": gc_full,  # the longest DP rank's, since the last step
            # oldest behavior version trained on at version t (-1: nothing selected)
            "selected_version_oldest": (float(t - reduced.selected_staleness_max)
                                        if reduced.selected_staleness_max >= 0 else -1.0),
            **self.ep.heartbeat.peer_counters(),  # rollout-side events, e.g. reward_errors
            **worker_health(self.ep, self.made.numel()),  # workers alive, lost, restarted; groups dropped
            **{f"groups_received_w{w}": float(n) for w, n in enumerate(per_worker.tolist())},
            **term_stats(result.stats),  # the loss's stats; the terms' over the trained tokens
            # the hub's train step by phase: what of it DP does not divide (the gradient reduce)
            **{f"train_{phase}_seconds": v for phase, v in result.phase_seconds.items()},
        }
        self.logger.log(step, step_metrics(reduced, trainer))

    def _sync_metrics(self) -> dict[str, float]:
        """The last finished weight sync: all of it, of which waiting for the workers' safe points,
        and the transfer of one round (what a worker waits for once at its safe point)."""
        r = self.sync
        if r is None:
            return {"weight_sync_seconds": 0.0, "weight_sync_wait_seconds": 0.0,
                    "weight_sync_transfer_seconds": 0.0, "weight_sync_rounds": 0.0}
        return {"weight_sync_seconds": r.seconds, "weight_sync_wait_seconds": r.wait_seconds,
                "weight_sync_transfer_seconds": r.transfer_seconds / max(r.rounds_sent, 1),
                "weight_sync_rounds": float(r.rounds_sent)}

    def _shutdown(self, step: int) -> None:
        if self.ps.rank == 0:  # past the last collective: the other ranks may leave before rank 0
            for r in range(1, self.ps.world_size):
                self.ep.heartbeat.unwatch(TRAINER, r)
        if self.heldout is not None:  # the points still out (the final version's), each bounded
            worker, wait = self.cfg.eval.worker, not self.fatal and self.stop.signum is None
            for point in self.heldout.drain(wait, lambda: self.ep.heartbeat.is_alive(WORKER, worker)):
                self.logger.log_heldout(point)
        if self.logger is not None:
            self.logger.close({"variant": self.cfg.algorithm.variant, "final_version": self.trainer.version})
        if self.ps.rank == 0:
            request_stop(self.ep.store)
            live = [w for w in range(self.cfg.topology.workers)
                    if self.ep.heartbeat.is_alive(WORKER, w)]
            missing = wait_for_exits(self.ep.store, WORKER, live, self.cfg.transport.heartbeat.timeout_s)
            if missing:
                log.warning("rollout workers %s did not confirm exit", missing)
        self.ep.close()
        self.gc.close()
        log.info("trainer rank %d stopped after step %d", self.ps.rank, step)


def run_trainer(cfg: RunConfig, trainer: PolicyTrainer, ps: ParallelState,
                say_why: Callable[[str], None] | None = None) -> int:
    """Run one trainer rank with its built trainer (``launch.trainer.build_trainer``). When another
    trainer rank is lost this rank exits at once (``endpoints``): the one line why, with the newest
    checkpoint to resume from, goes to the log and to ``say_why`` (the launcher's reason file)."""

    def leaving(line: str) -> None:
        line = f"{line}; {newest_checkpoint(cfg.loop.run_dir)}"
        log.error("%s", line)
        if say_why is not None:
            say_why(line)

    endpoints = open_endpoints(cfg.transport, cfg.bound, cfg.topology, ps, stage_bytes=trainer.hf_stage_bytes(),
                               say_why=leaving)
    try:
        loop = TrainerLoop(cfg, trainer, ps, endpoints, asdict(cfg))
    except BaseException:  # e.g. a damaged checkpoint to resume from: the endpoints' threads
        endpoints.close()  # (heartbeat, publisher) left running at exit aborted the process (-6)
        raise
    return loop.run()
