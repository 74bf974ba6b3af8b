"""The run's checkpoints behind one object, ``CheckpointManager``: save, load (verified against
its checksums first), retain, the resume points, when a checkpoint is due between steps, and which
checkpoint a failure names.

The trainer loop holds one manager and says only what its own state is (``extra_state``: the
shard's replay buffer and cache, the group counts), which it puts back after a resume. The
pieces underneath keep their own modules: ``training`` (a trainer's save and load),
``model_io`` (the model checkpoint format the converters share), ``checksums`` (the SHA-256
manifest), ``disk`` (room on disk), ``snapshots`` (the window's parameter snapshots) and
``resume_points`` (which directories of a run are resume points: the launcher's answer too).

Checkpoints between steps bound what a kill -9, an OOM kill or a lost node of any trainer rank
loses. A checkpoint is due at a step boundary by one of two rules (``loop.checkpoint_interval``):

* ``null`` (the default), by time: once the time since the last checkpoint ended reaches the
  next save's expected seconds / ``loop.checkpoint_overhead`` (67 x at 0.015). Periodic saves then
  take about that fraction of the run's wall time, whatever the model, the disk or the step
  time, and the work a crash loses is bounded by the same interval (plus the step in flight).
  The default leaves room under 2 % for saves of one size that vary by 1.5 x on a busy machine
  (measured on CPU, default main job, 120 steps of ~0.7 s: saves at steps 1, 36 and 118 of
  0.3-1.0 s took 2.1 % of the wall time, 1.8 % without the first). The expected seconds are the
  next checkpoint's bytes (``disk.checkpoint_bytes``: it grows while the window's parameter
  snapshots fill) at the slowest seconds per byte of the last four saves (a save slower than all
  of them is what can push the share over the target). Before the first save its speed is
  unknown and taken as ``PRIOR_BYTES_PER_S`` (1 GB/s a rank, a local disk): a save expected to
  take at most ``FIRST_SAVE_S`` follows the first step (learning the speed costs nothing, and a
  crash soon after loses one step), a longer one waits for the time rule at the prior speed. So a
  1.7B D-ARL checkpoint (~32 GB with its snapshots) comes about 35 minutes in, not before the
  second step, then at the measured pace.
* ``N > 0``: every N steps; ``0``: only at the end and on a signal.

Every rank must save together (the save is collective), so only rank 0's clock decides and the
loop spreads its answer with the per-step stop agreement (no extra collective).

A stop signal that SIGKILL follows (SIGTERM: ``scancel``, preemption) leaves ``loop.stop_grace_s``
(Slurm's ``KillWait``) for the step in flight and the save. When the save is expected to take
over half of that, the window's parameter snapshots stay out of it (``_snapshots_fit``): a
checkpoint without them resumes with older versions approximated for K - 1 steps, one cut off
by the kill resumes nothing.

A full disk: before each save (the final one included), when the checkpoint would not fit, what
retention would delete after it goes first, oldest first, and never the newest complete
checkpoint (``_make_room``), so a disk that holds about ``keep_checkpoints`` of them keeps
taking new ones. A checkpoint between steps that still cannot be written is logged and training
goes on (the next one tries again); the final one raises one line naming the filesystem, the bytes needed and the newest checkpoint.

``newest_checkpoint`` is the one a failure that cannot checkpoint (a frozen or dead trainer rank,
weights gone NaN) names for the resume.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_darl.checkpoint.disk import (
    CheckpointFailed, agreed_room, any_rank, checkpoint_bytes, existing_ancestor, free_bytes, gib,
)
from megatron_darl.checkpoint.resume_points import checkpoint_root, complete_checkpoints, latest_checkpoint
from megatron_darl.checkpoint.training import Resumed, load_checkpoint, save_checkpoint

log = logging.getLogger(__name__)
PRIOR_BYTES_PER_S = 1e9  # a rank's save speed assumed before its first save measured one
FIRST_SAVE_S = 2.0  # a first save expected to take at most this long follows the first step


@dataclass
class CheckpointSchedule:
    """Rank 0's rule for a checkpoint between steps (see the module docstring)."""

    interval: Optional[int]  # loop.checkpoint_interval: None = by time, 0 = never between steps
    overhead: float  # loop.checkpoint_overhead: fraction of wall time periodic saves may take
    last_end: float = field(default_factory=time.monotonic)  # when the last save ended (or the run began)
    last_seconds: Optional[float] = None  # the last save's duration; None before the first
    recent: deque = field(default_factory=lambda: deque(maxlen=4))  # seconds per byte of the last saves

    def due(self, step: int, start_step: int, steps: int, next_bytes: int = 1,
            now: float | None = None) -> bool:
        """Whether to checkpoint before ``step`` (steps ``start_step`` .. ``step - 1`` are done),
        the checkpoint then being ``next_bytes`` large."""
        if step <= start_step or step >= steps:  # nothing new, or the final checkpoint comes anyway
            return False
        if self.interval is not None:
            return self.interval > 0 and step % self.interval == 0
        if self.overhead <= 0:
            return False
        expected = self.expected_seconds(next_bytes)
        if not self.recent and expected <= FIRST_SAVE_S:
            return True
        now = time.monotonic() if now is None else now
        return now - self.last_end >= expected / self.overhead

    def expected_seconds(self, nbytes: int) -> float:
        """A save of ``nbytes`` at the slowest speed of the last saves (the prior before any)."""
        per_byte = max(self.recent) if self.recent else 1.0 / PRIOR_BYTES_PER_S
        return per_byte * max(nbytes, 1)

    def saved(self, seconds: float, nbytes: int = 1, now: float | None = None) -> None:
        """A checkpoint between steps of ``nbytes`` took ``seconds`` and ended ``now``."""
        self.last_seconds = seconds
        self.recent.append(seconds / max(nbytes, 1))
        self.last_end = time.monotonic() if now is None else now


def _bytes_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def newest_checkpoint(run_dir: str | Path) -> str:
    """One clause for a failure message: the checkpoint to resume from, or that there is none."""
    found = latest_checkpoint(run_dir)
    if found is None:
        return f"no checkpoint was written in {Path(run_dir) / 'checkpoints'} before it"
    return f"the newest checkpoint is {found} (resume from it with loop.resume=true)"


def grace_warning(name: str, seconds: float, grace_s: float | None) -> str:
    """Why a stop signal may save nothing, when a checkpoint took over half of ``grace_s`` (the
    seconds from SIGTERM to SIGKILL: Slurm's KillWait), else "". The step in flight must end
    first, so half is where a scancel stops being safe to count on."""
    if not grace_s or seconds <= grace_s / 2:
        return ""
    return (f"checkpoint {name} took {seconds:.1f} s; a stop signal leaves {grace_s:.0f} s "
            "(loop.stop_grace_s, Slurm's KillWait) for the step in flight and this save, so after a "
            "scancel the trainer may be killed first and lose the steps since the last complete "
            "checkpoint; stop it with `scancel --batch --signal=USR1 <job id>` (no deadline)")


class CheckpointManager:
    """One trainer rank's side of the run's checkpoints (see the module docstring).

    ``loop`` is the run's ``LoopConfig`` (``run_dir``, ``resume``, ``steps``,
    ``checkpoint_interval``, ``checkpoint_overhead``, ``keep_checkpoints`` are read), ``trainer``
    the ``PolicyTrainer`` and ``ps`` its ``ParallelState``. ``extra_state(next_step)`` is the
    loop's part of a checkpoint: on a hub rank its shard's state (a dict of tensors and plain
    types), None on the others. Every rank calls it (it may hold a collective), and only when a
    checkpoint is written."""

    def __init__(self, loop, trainer, ps, with_snapshots: bool,
                 extra_state: Callable[[int], dict[str, Any] | None]) -> None:
        self.cfg, self.trainer, self.ps = loop, trainer, ps
        self.warned_grace = False  # a save too slow for loop.stop_grace_s is said once
        self.run_dir = Path(loop.run_dir)
        self.with_snapshots = with_snapshots  # the window's parameter snapshots go in and come back
        self.extra_state = extra_state
        self.schedule = CheckpointSchedule(loop.checkpoint_interval, loop.checkpoint_overhead)

    def complete(self) -> list[Path]:
        """The run's resume points, oldest first (the launcher's answer too: ``resume_points``)."""
        return complete_checkpoints(self.run_dir)

    def newest(self) -> str:
        """The clause a failure message ends with: the checkpoint to resume from, or none."""
        return newest_checkpoint(self.run_dir)

    def load(self) -> tuple[Path, Resumed] | None:
        """With ``loop.resume``: the newest complete checkpoint loaded into the trainer, and what
        it held besides (a hub gets its own shard's extra state); None when there is none."""
        found = self.complete() if self.cfg.resume else []
        if not found:
            return None
        mine = [self.ps.dp_rank] if self.ps.is_hub else []  # the peers hold no replay state
        return found[-1], load_checkpoint(self.trainer, found[-1], with_snapshots=self.with_snapshots,
                                          extra_ranks=mine)

    def save(self, next_step: int, deadline: bool = False) -> Path:
        """Collective: the checkpoint before ``next_step`` (kept as it is when it exists already:
        resumed from it and stopped before another step), room made for it first, then retention.
        ``deadline`` (agreed by every rank): a stop signal that SIGKILL follows
        (``loop.stop_grace_s``), which may leave the window's snapshots out (``_snapshots_fit``).

        Raises:
            CheckpointFailed: one line naming the filesystem, the bytes needed and the newest
                checkpoint, which is never deleted to make room.
        """
        path = checkpoint_root(self.run_dir) / f"step_{next_step:06d}"
        if path.exists():
            return path
        start = time.monotonic()
        snapshots = self.with_snapshots and (not deadline or self._snapshots_fit(path.name))
        nbytes = checkpoint_bytes(self.trainer, self._old_snapshots() if snapshots else 0)
        extra = self.extra_state(next_step)
        deleted = self._make_room(path)
        phases: dict = {}
        try:
            path = save_checkpoint(self.trainer, path, extra_state=extra, with_snapshots=snapshots,
                                   phases=phases)
        except CheckpointFailed as exc:
            made = f" ({', '.join(deleted)} deleted to make room first)" if deleted else ""
            raise type(exc)(f"{exc}{made}; {self.newest()}") from exc
        if self.ps.rank == 0:  # the time a stop signal's checkpoint needs (Slurm's KillWait bounds it)
            seconds = time.monotonic() - start
            parts = ", ".join(f"{name} {t:.1f} s" for name, t in phases.items())
            log.info("checkpoint %s in %.2f s (%.2f GB on this rank: %s)", path, seconds, nbytes / 1e9, parts)
            warning = grace_warning(path.name, seconds, self.cfg.stop_grace_s)
            if warning and not self.warned_grace:
                self.warned_grace = True
                log.warning("%s", warning)
        self.retain(path)
        return path

    def _snapshots_fit(self, name: str) -> bool:
        """Collective: whether a stop checkpoint with the window's parameter snapshots is expected
        within half of ``loop.stop_grace_s`` on every rank (at the measured pace, or the prior).

        A 1.7B checkpoint is 34.4 GB on one trainer GPU, 10.3 GB of it three snapshots, and took
        44 s where Slurm's KillWait gives 30: the whole write was lost. Without the snapshots the
        checkpoint is exact for the weights, optimizer, buffer and counters; the resumed run
        backfills versions older than its first step from the nearest cached one for K - 1 steps,
        as after any checkpoint without them (``snapshots.load_snapshots`` says so on resume)."""
        grace, old = self.cfg.stop_grace_s, self._old_snapshots()
        if not grace or not old:
            return True
        expected = self.schedule.expected_seconds(self.next_bytes())
        late = any_rank(expected > grace / 2)
        if late and self.ps.rank == 0:
            log.warning("stop checkpoint %s without the window's %d parameter snapshots: expected "
                        "%.0f s with them, and the stop leaves %.0f s (loop.stop_grace_s); the resumed "
                        "run backfills older versions from the nearest cached one for K - 1 steps",
                        name, old, expected, grace)
        return not late

    def _make_room(self, path: Path) -> list[str]:
        """Collective: when the next checkpoint would not fit, rank 0 deletes what retention would
        delete after it anyway, oldest first (partial ``.tmp`` writes, then the oldest kept
        checkpoints), until it fits; never the newest complete one, nothing when even deleting all
        of them would not make room, and only with
        ``loop.keep_checkpoints`` > 0 (0 keeps all). The need is the larger of the estimate and the
        newest checkpoint's bytes on disk (the estimate is of the tensor payload only), plus 5 %.
        Returns the names deleted (rank 0; [] elsewhere)."""
        if not self.cfg.keep_checkpoints:
            return []
        need, free = agreed_room(self.trainer, path, self._old_snapshots())
        deleted: list[str] = []
        if self.ps.rank == 0:
            kept = self.complete()
            need = int(1.05 * max(need, _bytes_on_disk(kept[-1]) if kept else 0))
            spare = [p for p in path.parent.glob("step_*.tmp") if p.name != f"{path.name}.tmp"] + kept[:-1]
            if free + sum(_bytes_on_disk(p) for p in spare) < need:
                spare = []  # deleting them all would not make room: keep them (the save is refused)
            before = free
            while free < need and spare:
                victim = spare.pop(0)
                shutil.rmtree(victim, ignore_errors=True)
                deleted.append(victim.name)
                free = free_bytes(path.parent)
            if deleted:
                log.warning("%s needs about %s and the filesystem of %s had %s free: deleted %s to make "
                            "room (%s free now; the newest checkpoint is kept)", path.name, gib(need),
                            existing_ancestor(path.parent), gib(before), ", ".join(deleted), gib(free))
        if self.ps.world_size > 1:
            torch.distributed.barrier()  # every rank sees the room before its own check
        return deleted

    def due(self, step: int, start_step: int) -> bool:
        """Rank 0's verdict on a checkpoint before ``step`` (False on the other ranks: the loop
        spreads rank 0's answer)."""
        return self.ps.rank == 0 and self.schedule.due(step, start_step, self.cfg.steps, self.next_bytes())

    def save_between(self, step: int) -> None:
        """A checkpoint between steps that cannot be written (full disk) is logged and training goes
        on: the run's state is in memory, and the next checkpoint tries again. At the end it raises."""
        start, nbytes = time.monotonic(), self.next_bytes()
        try:
            self.save(step)
        except CheckpointFailed as exc:
            log.error("%s; training goes on, the next checkpoint (at the end at the latest) tries again", exc)
            return
        finally:
            self.schedule.saved(time.monotonic() - start, nbytes)

    def next_bytes(self) -> int:
        """This rank's share of the next checkpoint's tensor bytes (the schedule scales by it)."""
        return checkpoint_bytes(self.trainer, self._old_snapshots())

    def _old_snapshots(self) -> int:
        """The parameter snapshots the next checkpoint carries besides the current weights."""
        trainer = self.trainer
        return len([v for v in trainer.snapshots.versions if v != trainer.version]) if self.with_snapshots else 0

    def retain(self, newest: Path) -> None:
        """Keep the newest ``loop.keep_checkpoints`` complete checkpoints (0: all); rank 0 deletes
        the older ones, and the partial ``.tmp`` writes older than ``newest``, only once it exists."""
        keep = self.cfg.keep_checkpoints
        if not keep or self.ps.rank != 0:
            return
        old = [p for p in self.complete()[:-keep] if p != newest]  # sorted by step, newest last
        old += [p for p in newest.parent.glob("step_*.tmp") if p.name < newest.name]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        if old:
            log.info("kept the newest %d checkpoints; deleted %s", keep, ", ".join(p.name for p in old))
