"""The trainer-side D-ARL loop: receive -> plan -> train -> publish -> evict, one weight version
per iteration (M x epochs PPO mini-batch optimizer steps); synchronous training is the same loop
with eta = 0 and K = 1 (``configs/algorithm/sync.yaml``).

A step starts once the hubs hold the step's B new groups; groups beyond that count for the next
steps (``endpoints.Backlog``).

Every trainer rank runs this. The algorithm lives in ``ShardPlanner.step`` (one per DP shard, on
the shard's hub rank only, with the replay buffer and log-prob cache; its TP/PP peers get each
step's batches by broadcast: ``replica.py``) and ``step.StepRunner`` (plan and train with the
trainer); the transport ends in
``endpoints``; metrics are reduced over DP and written by rank 0. SIGTERM, SIGINT or SIGUSR1
finish the current step, write a checkpoint (model, optimizer, RNG, step, version, each shard's
buffer and cache, and the parameter snapshots of the window when the variant backfills from
them) and exit 0; ``loop.resume`` continues from the latest one.

When the rollout side fails for good (no group for ``loop.receive_timeout_s``, every worker
lost, or a weight sync that no worker could take) the rank that saw it says why, every rank
agrees on it at the next step boundary, the run checkpoints the same way and ``run`` raises
``RunAborted`` with that one line: the run's work is kept and the exit is non-zero.

Failures that leave no chance to checkpoint are covered by checkpoints between steps
(``checkpoint_policy``: by default once the time since the last one reaches about 67 times a
save's duration, ``loop.checkpoint_overhead``): a killed or frozen trainer rank (every rank is
watched, ``endpoints``), or a loss or gradient norm gone NaN/Inf, whose weights are neither
published nor checkpointed. Either way the line names the newest checkpoint to resume from.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_darl.loop.checkpoint_policy import CheckpointSchedule, newest_checkpoint
from megatron_darl.loop.checkpoints import complete_checkpoints
from megatron_darl.loop.config import ModelConfig, density_temperature
from megatron_darl.loop.endpoints import (
    Backlog, TrainerEndpoints, open_endpoints, publish_weights, receive_groups,
    wait_for_workers, worker_health,
)
from megatron_darl.loop.metrics import MetricsLogger, WorkerRates, step_metrics
from megatron_darl.loop.resume import mark_ready, seed_store
from megatron_darl.loop.run_config import RunConfig
from megatron_darl.step.planner import ShardPlanner
from megatron_darl.step.runner import StepClock, StepRunner, uses_snapshots
from megatron_darl.step.stats import StepStats
from megatron_darl.transport import TRAINER, WORKER, TransportTimeout, WeightSyncFailed
from megatron_darl.transport.weight_protocol import SyncReport

log = logging.getLogger(__name__)


class RunAborted(RuntimeError):
    """The trainer gave up after writing a checkpoint; the message is the one line saying why."""


@dataclass
class DistEnv:
    """This process's place in the trainer world (from torchrun-style variables, read by launch)."""

    rank: int  # global trainer rank
    world_size: int  # trainer ranks
    master_addr: str  # torch.distributed rendezvous host
    master_port: int  # torch.distributed rendezvous port


class _StopFlag:
    """SIGTERM/SIGINT/SIGUSR1 set a flag; the loop checkpoints at the end of the current step.
    SIGUSR1 is what ``sbatch --signal=USR1@<seconds>`` sends ahead of a time limit or preemption."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(s, self._set)

    def _set(self, signum: int, frame) -> None:  # noqa: ARG002 (signal API)
        log.warning("signal %d: checkpointing after this step", signum)
        self.signum = signum


def _hf_config(model: ModelConfig) -> dict[str, Any]:
    if model.path:
        from megatron_darl.models.qwen3.config import load_hf_config_dict

        return load_hf_config_dict(model.path)
    if model.hf_config:
        return dict(model.hf_config)
    raise ValueError("model.path and model.hf_config are both empty (launch resolves the warm start)")


def build_trainer(cfg: RunConfig, env: DistEnv):
    """Process groups and the ``PolicyTrainer``, initialised from ``model.path`` when given,
    scoring the rollout sampler's density (``sampling.temperature``)."""
    import dataclasses

    from megatron_darl.trainer.parallel import init_parallel
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    ps = init_parallel(cfg.parallel, rank=env.rank, world_size=env.world_size,
                       init_method=f"tcp://{env.master_addr}:{env.master_port}")
    tcfg = cfg.trainer
    if cfg.model.path and not tcfg.init_checkpoint:
        tcfg = dataclasses.replace(tcfg, init_checkpoint=cfg.model.path)
    s = cfg.sampling
    temperature = density_temperature(s.temperature, s.top_p, s.top_k)
    return PolicyTrainer(tcfg, ps, _hf_config(cfg.model), temperature=temperature), ps


class TrainerLoop:
    """One trainer rank's run; ``run()`` returns the process exit code."""

    def __init__(self, cfg: RunConfig, trainer, ps, endpoints: TrainerEndpoints,
                 run_config: dict[str, Any] | None = None) -> None:
        self.cfg, self.trainer, self.ps, self.ep = cfg, trainer, ps, endpoints
        self.planner = (ShardPlanner(cfg.algorithm, cfg.replay, shard=ps.dp_rank, num_shards=ps.dp_size)
                        if self.ps.is_hub else None)
        self.runner = StepRunner(cfg.algorithm, cfg.replay, self.planner, trainer, ps)
        self.use_snapshots = uses_snapshots(cfg.algorithm)
        self.run_dir = Path(cfg.loop.run_dir)
        workers = cfg.transport.control.num_workers
        self.base_received, self.received = 0, 0  # groups: restored global total, local since
        self.backlog = Backlog(cfg.algorithm.groups_per_step)  # hubs: groups beyond B for the next steps
        self.base_made = torch.zeros(workers, dtype=torch.int64)  # per worker groups received
        self.made = torch.zeros(workers, dtype=torch.int64)
        self.step_groups = torch.zeros(workers, dtype=torch.int64)  # per worker groups received this step
        self.start_step = self._maybe_resume()
        if ps.rank == 0:
            if self.start_step > 0:
                seed_store(endpoints.store, self.base_received, self.base_made.tolist())
            mark_ready(endpoints.store)
        self.logger = MetricsLogger(cfg.loop, run_config, self.start_step) if ps.rank == 0 else None
        self.stop = _StopFlag()
        self._world_gloo = torch.distributed.new_group(backend="gloo") if ps.world_size > 1 else None
        self.sync: SyncReport | None = None  # the last weight sync that finished (stage leaders)
        self.fatal = ""  # why this rank saw the run fail for good (transport), "" while it can go on
        self.diverged = False  # the weights went NaN/Inf: no checkpoint may be written of them
        self.schedule = CheckpointSchedule(cfg.loop.checkpoint_interval, cfg.loop.checkpoint_overhead)
        self._save_due = False  # agreed at the last step boundary: checkpoint before the next step
        self._rates = WorkerRates(workers)  # rank 0: per-worker rollout metrics

    # ---- checkpoints ------------------------------------------------------------------------
    def _checkpoints(self) -> list[Path]:
        return complete_checkpoints(self.run_dir)  # the launcher's answer too (loop/checkpoints.py)

    def _maybe_resume(self) -> int:
        found = self._checkpoints() if self.cfg.loop.resume else []
        if not found:
            return 0
        from megatron_darl.trainer.checkpoint import load_checkpoint

        mine = [self.ps.dp_rank] if self.ps.is_hub else []  # the peers hold no replay state
        resumed = load_checkpoint(self.trainer, found[-1], with_snapshots=self.use_snapshots,
                                  extra_ranks=mine)
        step = -1
        if self.ps.is_hub:
            extra = resumed.extra_states[self.ps.dp_rank]
            self.planner.load_state_dict(extra["planner"])
            self.base_received = int(extra["groups_received"])
            self.base_made = torch.as_tensor(extra["worker_groups"], dtype=torch.int64)
            step = int(extra["step"])
            self.backlog.surplus = max(0, self.base_received - step * self.cfg.algorithm.groups_per_step)
        step = self.runner.link.share(step)
        log.info("resumed from %s at step %d, version %d", found[-1], step, resumed.version)
        return step

    def save(self, next_step: int) -> Path:
        from megatron_darl.trainer.checkpoint import save_checkpoint

        path = self.run_dir / "checkpoints" / f"step_{next_step:06d}"
        if path.exists():  # resumed from it and stopped before another step
            return path
        received = self.base_received + int(self.ps.dp_sum(torch.tensor([self.received])))
        made = torch.maximum(self.base_made, self.ps.dp_max(self.made.clone()))
        extra = None if self.planner is None else {
            "planner": self.planner.state_dict(), "step": next_step,
            "groups_received": received, "worker_groups": made.tolist()}
        path = save_checkpoint(self.trainer, path, extra_state=extra, with_snapshots=self.use_snapshots)
        self._prune(path)
        return path

    def _prune(self, newest: Path) -> None:
        """Keep the newest ``loop.keep_checkpoints`` complete checkpoints (0: all); rank 0 deletes
        the older ones, and the partial ``.tmp`` writes older than ``newest``, only once it exists."""
        keep = self.cfg.loop.keep_checkpoints
        if not keep or self.ps.rank != 0:
            return
        old = [p for p in self._checkpoints()[:-keep] if p != newest]  # sorted by step, newest last
        old += [p for p in newest.parent.glob("step_*.tmp") if p.name < newest.name]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        if old:
            log.info("kept the newest %d checkpoints; deleted %s", keep, ", ".join(p.name for p in old))

    def _save_between(self, step: int) -> None:
        """A checkpoint between steps that cannot be written (full disk) is logged and training goes
        on: the run's state is in memory, and the next checkpoint tries again. At the end it raises."""
        from megatron_darl.trainer.disk import CheckpointFailed

        start, nbytes = time.monotonic(), self._checkpoint_bytes()
        try:
            path = self.save(step)
        except CheckpointFailed as exc:
            log.error("%s; training goes on, the next checkpoint (at the end at the latest) tries again", exc)
            return
        finally:
            self.schedule.saved(time.monotonic() - start, nbytes)
        if self.ps.rank == 0:
            log.info("checkpoint %s in %.2f s (%.1f MB on this rank)", path, self.schedule.last_seconds, nbytes / 1e6)

    def _checkpoint_bytes(self) -> int:
        """This rank's share of the next checkpoint's tensor bytes (the schedule scales by it)."""
        from megatron_darl.trainer.disk import checkpoint_bytes

        old = [v for v in self.trainer.snapshots.versions if v != self.trainer.version] if self.use_snapshots else []
        return checkpoint_bytes(self.trainer, len(old))

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        """Train to ``loop.steps`` (0); raises ``RunAborted`` after the checkpoint when it gave up."""
        if self.use_snapshots:
            self.trainer.snapshot(keep=self.runner.window.versions(self.trainer.version))
        step, saved = self.start_step, None
        try:
            if step > 0:  # a resumed run: fresh workers must get the resumed weights first
                wait_for_workers(self.ep, self.ps, self.cfg.transport.control.num_workers,
                                 self.cfg.loop.receive_timeout_s, tag=step)
                self._publish()
            while step < self.cfg.loop.steps and not self._stop_agreed(step):
                if self._save_due:
                    self._save_between(step)
                self.ep.heartbeat.step = step
                if not self.step(step):
                    break
                step += 1
            self._finish_publish()
            self._stop_agreed(step)  # a failure in the last step's publish: every rank learns it
            if not self.diverged:  # NaN weights are never checkpointed: the newest one stays the last good
                saved = self.save(step)
        finally:
            self._shutdown(step)
        if self.fatal:
            raise RunAborted(self.fatal if self.diverged else f"{self.fatal}; checkpoint {saved} written")
        return 0

    def _stop_agreed(self, step: int) -> bool:
        """True on every trainer rank when any rank got the signal or gave up: ranks that saw it
        a moment apart must still leave the loop at the same step (a rank alone would hang the
        others' collectives). One tiny gloo all-reduce per step; on a failure every rank takes
        the first rank's reason (one more collective, once). The same all-reduce carries rank 0's
        verdict on a checkpoint before ``step`` (``_save_due``: every rank saves, or none)."""
        due = self.ps.rank == 0 and self.schedule.due(step, self.start_step, self.cfg.loop.steps,
                                                      self._checkpoint_bytes())
        flag = torch.tensor([int(self.stop.signum is not None), int(bool(self.fatal)), int(due)],
                            dtype=torch.int64)
        if self.ps.world_size > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._world_gloo)
        if int(flag[1]) and self.ps.world_size > 1:
            reasons: list[str] = [""] * self.ps.world_size
            torch.distributed.all_gather_object(reasons, self.fatal, group=self._world_gloo)
            self.fatal = next(r for r in reasons if r)
        self._save_due = bool(flag[2])
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
        clock = StepClock(receive_wait_seconds=time.monotonic() - start)
        plan = self.runner.plan(groups, step, clock)  # TP/PP peers: the hub's mini-batches
        result = self.runner.train(plan, clock)
        if self._diverged(step, result):
            return False
        self._publish()
        clock.lap("publish_seconds")
        if self.planner is not None:  # the hub: end the step, log it
            self.planner.evict(self.trainer.version, plan.stats)
            self._log(step, t, plan.stats, result, clock.laps, time.monotonic() - start)
        return True

    def _diverged(self, step: int, result) -> bool:
        """A loss or gradient norm that is NaN/Inf stops the run before the weights it produced
        are published or checkpointed (the same numbers on every rank: all ranks stop here)."""
        clipped = self.cfg.trainer.optimizer.clip_grad > 0  # else Megatron computes no norm (NaN stands in)
        bad = [f"{name} {value}" for name, value, on in (("loss", result.loss, True),
                                                          ("gradient norm", result.grad_norm, clipped))
               if on and not math.isfinite(value)]
        if not bad:
            return False
        self.diverged = True
        self.fatal = (f"trainer step {step}: {' and '.join(bad)}: the weights of version {self.trainer.version} "
                      f"are not trustworthy, so they were neither published nor checkpointed; "
                      f"{newest_checkpoint(self.run_dir)}")
        log.error("%s", self.fatal)
        return True

    def _receive(self, step: int) -> list | None:
        """This replica's new groups of ``step``, or None when a signal or a failure cut the wait
        (a background weight sync that failed cuts it too, and is the cause named)."""
        publisher = self.ep.publisher
        received = receive_groups(self.ep, self.ps, self.backlog.need(), self.cfg.loop.receive_timeout_s, step,
                                  self.cfg.transport.control.poll_interval_s,
                                  self.cfg.transport.control.num_workers,
                                  stop=lambda: self.stop.signum is not None or (
                                      publisher is not None and publisher.failure() is not None))
        if received.stopped or received.fatal:
            failed = publisher.failure(wait_s=5.0 if received.fatal else 0.0) if publisher is not None else None
            self.fatal = f"trainer rank {self.ps.rank}: {failed}" if failed is not None else received.fatal
            if self.fatal:
                log.error("%s", self.fatal)
            return None
        self.backlog.took(received.total)
        self._count(received.groups)
        return received.groups

    def _count(self, groups) -> None:
        """Received groups, and per worker how many it made (group ids fold the worker id in)."""
        workers = self.made.numel()
        self.received += len(groups)
        for g in groups:
            self.made[g.worker_id] = max(int(self.made[g.worker_id]), g.group_id // workers + 1)
            self.step_groups[g.worker_id] += 1

    def _log(self, step: int, t: int, stats: StepStats, result, laps: dict[str, float],
             wall_s: float) -> None:
        reduced = stats.reduce(self.ps.dp_sum, self.ps.dp_max)
        per_worker, self.step_groups = self.ps.dp_sum(self.step_groups), torch.zeros_like(self.step_groups)
        if self.logger is None:
            return
        gen_s = max(wall_s, 1e-9)  # groups arrive at the pace of generation in steady state
        trainer = {
            "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
            "trainer_tokens_per_s": result.tokens_per_s, "mfu": result.mfu,
            "rollout_tokens_per_s": reduced.response_tokens_received / gen_s,
            "step_seconds": wall_s, **self._sync_metrics(), **laps,
            **self._rates.step(lambda w: self.ep.heartbeat.peer_stats(WORKER, w)),
            "version": float(self.trainer.version),
            "optimizer_steps": float(result.optimizer_steps),
            # oldest behavior version trained on at version t (-1: nothing selected)
            "selected_version_oldest": (float(t - reduced.selected_staleness_max)
                                        if reduced.selected_staleness_max >= 0 else -1.0),
            **self.ep.heartbeat.peer_counters(),  # rollout-side events, e.g. reward_errors
            **worker_health(self.ep, self.made.numel()),  # workers alive, lost, restarted; groups dropped
            **{f"groups_received_w{w}": float(n) for w, n in enumerate(per_worker.tolist())},
            **{k: v for k, v in result.stats.items()},
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
        from megatron_darl.transport import request_stop, wait_for_exits

        if self.ps.rank == 0:  # past the last collective: the other ranks may leave before rank 0
            for r in range(1, self.ps.world_size):
                self.ep.heartbeat.unwatch(TRAINER, r)
        if self.logger is not None:
            self.logger.close({"variant": self.cfg.algorithm.variant, "final_version": self.trainer.version})
        if self.ps.rank == 0:
            request_stop(self.ep.store)
            live = [w for w in range(self.cfg.transport.control.num_workers)
                    if self.ep.heartbeat.is_alive(WORKER, w)]
            missing = wait_for_exits(self.ep.store, WORKER, live, self.cfg.transport.heartbeat.timeout_s)
            if missing:
                log.warning("rollout workers %s did not confirm exit", missing)
        self.ep.close()
        log.info("trainer rank %d stopped after step %d", self.ps.rank, step)


def run_trainer(cfg: RunConfig, env: DistEnv, say_why: Callable[[str], None] | None = None) -> int:
    """Entry of one trainer rank (called by ``launch.trainer``). When another trainer rank is
    lost this rank exits at once (``endpoints``): the one line why, with the newest checkpoint to
    resume from, goes to the log and to ``say_why`` (the launcher's reason file)."""
    trainer, ps = build_trainer(cfg, env)

    def leaving(line: str) -> None:
        line = f"{line}; {newest_checkpoint(cfg.loop.run_dir)}"
        log.error("%s", line)
        if say_why is not None:
            say_why(line)

    endpoints = open_endpoints(cfg.transport, ps, stage_bytes=trainer.hf_stage_bytes(), say_why=leaving)
    try:
        loop = TrainerLoop(cfg, trainer, ps, endpoints, asdict(cfg))
    except BaseException:  # e.g. a damaged checkpoint to resume from: the endpoints' threads
        endpoints.close()  # (heartbeat, publisher) left running at exit aborted the process (-6)
        raise
    return loop.run()
