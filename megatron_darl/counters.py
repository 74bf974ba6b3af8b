"""Process-wide event counters that reach the trainer's metrics through the heartbeat.

Why a module of its own: the events worth counting happen deep in leaf components (a reward that
could not be computed, in a reward thread of a rollout worker) that must not import the
transport, and they must end up in ``metrics.jsonl`` on trainer rank 0, another process. So
leaves call ``count(name)``; every heartbeat carries this process's ``snapshot()``; trainer rank 0
sums the latest snapshot of each peer (``Heartbeat.peer_counters``) into each step's metrics.
Counts are cumulative over a process's life. The module imports nothing of ours.
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_COUNTS: dict[str, int] = {}

REWARD_ERRORS = "reward_errors"  # rewards scored 0.0 because the verifier could not run (bad reference)
REWARD_TIMEOUTS = "reward_timeouts"  # rewards scored 0.0 because the verifier missed its deadline


def count(name: str, n: int = 1) -> int:
    """Add ``n`` to counter ``name``; returns the new total."""
    with _LOCK:
        _COUNTS[name] = _COUNTS.get(name, 0) + n
        return _COUNTS[name]


def snapshot() -> dict[str, int]:
    """A copy of every counter of this process."""
    with _LOCK:
        return dict(_COUNTS)
