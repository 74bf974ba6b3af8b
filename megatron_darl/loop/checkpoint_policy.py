"""When the trainer loop checkpoints between steps, and which checkpoint a failure leaves behind.

Why: a run used to checkpoint only at its end or on a signal, so a kill -9, an OOM kill or a lost
node of any trainer rank lost every step since the start. Now a checkpoint is due at a step
boundary by one of two rules (``loop.checkpoint_interval``):

* ``null`` (the default), by time: once the time since the last checkpoint ended reaches the
  next save's expected seconds / ``loop.checkpoint_overhead`` (67 x at 0.015). Periodic saves then
  take about that fraction of the run's wall time, whatever the model, the disk or the step
  time, and the work a crash loses is bounded by the same interval (plus the step in flight).
  The default leaves room under 2 % for saves of one size that vary by 1.5 x on a busy machine
  (measured on CPU, default main job, 120 steps of ~0.7 s: saves at steps 1, 36 and 118 of
  0.3-1.0 s took 2.1 % of the wall time, 1.8 % without the first). The expected seconds are the
  next checkpoint's bytes (``disk.checkpoint_bytes``: it grows while the window's parameter
  snapshots fill) at the slowest seconds per byte of the last four saves (a save slower than all
  of them is what can push the share over the target). A save's speed is unknown until one ran,
  so the first is due after the first step (and after the first step of a resumed run): one
  save's cost, once.
* ``N > 0``: every N steps; ``0``: only at the end and on a signal.

Every rank must save together (the save is collective), so only rank 0's clock decides and the
loop spreads its answer with the per-step stop agreement (no extra collective).

``newest_checkpoint`` is the one a failure that cannot checkpoint (a frozen or dead trainer rank,
weights gone NaN) names for the resume.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_darl.loop.checkpoints import latest_checkpoint


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
        if not self.recent:
            return True
        now = time.monotonic() if now is None else now
        return now - self.last_end >= self.expected_seconds(next_bytes) / self.overhead

    def expected_seconds(self, nbytes: int) -> float:
        """A save of ``nbytes`` at the slowest speed of the last saves."""
        return max(self.recent) * max(nbytes, 1)

    def saved(self, seconds: float, nbytes: int = 1, now: float | None = None) -> None:
        """A checkpoint between steps of ``nbytes`` took ``seconds`` and ended ``now``."""
        self.last_seconds = seconds
        self.recent.append(seconds / max(nbytes, 1))
        self.last_end = time.monotonic() if now is None else now


def newest_checkpoint(run_dir: str | Path) -> str:
    """One clause for a failure message: the checkpoint to resume from, or that there is none."""
    found = latest_checkpoint(run_dir)
    if found is None:
        return f"no checkpoint was written in {Path(run_dir) / 'checkpoints'} before it"
    return f"the newest checkpoint is {found} (resume from it with loop.resume=true)"
