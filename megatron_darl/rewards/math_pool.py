"""Math verification with a hard timeout from any thread, through helper processes.

math-verify bounds parsing and comparison with ``signal.alarm``, which only works in a
process's main thread, and even there a long C-level computation (a huge integer power inside
sympy) is not interrupted until it returns. The rollout worker scores responses in a thread
pool, so a pathological response could otherwise hang a reward thread forever. Off the main
thread, ``math_answer`` therefore hands the check to a helper process
(``python -m megatron_darl.rewards.math_worker``, one JSON line in, one out) that runs it in its
own main thread with math-verify's timeouts; the caller waits at most ``hard_timeout`` seconds,
and a helper that does not answer by then is killed (only that one) and replaced; the check
scores 0.0. Helpers are plain subprocesses, not ``multiprocessing`` workers, so they never
re-import the caller's ``__main__``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
from pathlib import Path

from megatron_darl import counters

logger = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # so helpers import this checkout
_idle: queue.Queue = queue.Queue()
_lock = threading.Lock()
_live: set = set()  # every helper not yet killed
_WAIT_POLL_S = 0.05  # all helpers busy: how often a waiting check looks for room again


class _Helper:
    """One ``math_worker`` subprocess, used by one thread at a time."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_darl.rewards.math_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, bufsize=1,
        )

    def ask(self, request: str, timeout: float) -> str | None:
        """The helper's one-line reply, or None when it did not answer in time (or died)."""
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() or None if ready else None

    def kill(self) -> None:
        self.proc.kill()
        try:
            self.proc.wait(timeout=5.0)  # SIGKILL: at once, unless stuck in the kernel (then left)
        except subprocess.TimeoutExpired:
            pass


def _acquire(max_helpers: int) -> _Helper:
    """An idle helper, or a new one while fewer than ``max_helpers`` live. All busy: wait, and
    look again every ``_WAIT_POLL_S``, since a busy helper past its timeout is killed rather than
    put back, and the room it leaves is only seen by looking (each busy one ends within its
    caller's hard timeout, so the wait is bounded by theirs)."""
    while True:
        with _lock:
            if _idle.empty() and len(_live) < max_helpers:
                helper = _Helper()
                _live.add(helper)
                return helper
        try:
            return _idle.get(timeout=_WAIT_POLL_S)
        except queue.Empty:
            continue


def _discard(helper: _Helper) -> None:
    with _lock:
        _live.discard(helper)
    helper.kill()


def shutdown() -> None:
    """Kill every helper (new ones start on the next call)."""
    with _lock:
        helpers = list(_live)
        _live.clear()
    while not _idle.empty():
        _idle.get_nowait()
    for helper in helpers:
        helper.kill()


atexit.register(shutdown)


def verify_in_helper(request: dict, hard_timeout: float, max_helpers: int) -> float:
    """Score ``request`` (``math_worker``'s input) in a helper process; 0.0 past the timeout.

    Raises:
        ValueError: the helper reported a ``ValueError`` (an unparseable reference).
    """
    helper = _acquire(max_helpers)
    try:
        line = helper.ask(json.dumps(request), hard_timeout)
    except (BrokenPipeError, OSError):
        line = None
    if line is None:
        total = counters.count(counters.REWARD_TIMEOUTS)
        logger.warning("math verification gave no answer within %.1fs (timeout %d, scored 0.0); replacing its "
                       "helper", hard_timeout, total)
        _discard(helper)
        return 0.0
    _idle.put(helper)
    reply = json.loads(line)
    if reply.get("error") == "ValueError":
        raise ValueError(reply["message"])
    return float(reply.get("reward", 0.0))
