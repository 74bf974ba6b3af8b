"""A stop asked for through a file in the run dir, besides the signal: ``<run_dir>/stop_request``.

Why: a stop signal reaches the trainer through a Python handler, and a native library can take
the signal over below Python while it compiles (on a GPU host, Triton's LLVM does on a fresh
cache); the trainer arms its handlers again at every step boundary, but a signal that lands in
between is swallowed, and Slurm's warning signal (``--signal=B:USR1@600``) comes once. So whoever
forwards a stop signal to the trainer (the local launcher, ``slurm/launch.sh``) also writes the
signal's name into this file, and trainer rank 0 reads it at every step boundary and while it
waits for groups (the loop's stop agreement spreads it to every rank). A user may write it too:
``touch <run_dir>/stop_request`` stops a run after its current step, with a checkpoint, as
SIGUSR1 does (no deadline); ``echo SIGTERM > ...`` as SIGTERM does.

The launchers remove the file before the trainer starts (a request is for the launch in
progress: a resumed run must not stop at once), and rank 0 removes it once the stop is done.
Torch-free: the launcher imports it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

STOP_REQUEST = "stop_request"
CHECK_EVERY_S = 1.0  # while waiting for groups: one stat a second (the run dir may be on Lustre)

log = logging.getLogger(__name__)


def request_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STOP_REQUEST


def write_request(run_dir: str | Path, signum: int) -> None:
    """Ask the run's trainer to stop as ``signum`` would (written whole: a reader never sees half)."""
    path = request_path(run_dir)
    tmp = path.with_name(f".{STOP_REQUEST}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{signal.Signals(signum).name}\n")
        os.replace(tmp, path)
    except OSError as exc:  # the signal itself still goes out; only its backup is lost
        log.warning("could not write the stop request %s: %s", path, exc)


def clear_request(run_dir: str | Path) -> None:
    request_path(run_dir).unlink(missing_ok=True)


def read_request(path: Path) -> int | None:
    """The signal number a request file asks for; ``None`` when there is none. An empty file or
    one that names no stop signal asks for SIGUSR1 (a stop with no deadline)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("stop request %s unreadable (%s): stopping as SIGUSR1 does", path, exc)
        return signal.SIGUSR1
    name = text.split()[0].upper() if text else ""
    name = name if name.startswith("SIG") else f"SIG{name}"
    if name in ("SIGTERM", "SIGINT", "SIGUSR1"):
        return signal.Signals[name]
    if text:
        log.warning("stop request %s says %r, not SIGTERM, SIGINT or SIGUSR1: stopping as SIGUSR1 does",
                    path, text[:40])
    return signal.SIGUSR1


class RequestWatch:
    """Rank 0's look at the request file: ``poll()`` at most once per ``every_s``, ``check()`` now."""

    def __init__(self, run_dir: str | Path | None, every_s: float = CHECK_EVERY_S) -> None:
        self.path = None if run_dir is None else request_path(run_dir)
        self.every_s = every_s
        self._last = float("-inf")

    def check(self) -> int | None:
        if self.path is None:
            return None
        self._last = time.monotonic()
        signum = read_request(self.path)
        if signum is not None:
            log.warning("%s asks for a stop (%s): checkpointing after this step", self.path,
                        signal.Signals(signum).name)
        return signum

    def poll(self) -> int | None:
        if self.path is None or time.monotonic() - self._last < self.every_s:
            return None
        return self.check()

    def done(self) -> None:
        """The stop it asked for is done: the next launch starts clean."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
