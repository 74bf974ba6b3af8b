"""Python's garbage collector on a trainer rank, timed per step.

Why: a full (generation 2) collection walks every object the process tracks, and a trainer rank
tracks many (torch, Megatron, transformers, the replay buffer's records). It stops the rank at
whatever point of the step it falls on, and with DP > 1 the other ranks wait for it at the next
gradient reduce: a pause on one rank is a pause on all. The step metrics carry ``gc_seconds``
(the longest of the DP ranks) and ``gc_full_collections`` so that a slow step can be told apart
from a collection. ``gc.callbacks`` reports each collection's start and stop; the clock sums
the time between them.
"""

from __future__ import annotations

import gc
import time


class GcClock:
    """Seconds spent in collections (and how many were full) since the last ``take``."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._seconds = 0.0
        self._full = 0
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._started = None
            self._full += int(info.get("generation", 0) == 2)

    def take(self) -> tuple[float, int]:
        """(seconds in collections, full collections) since the last call; resets both."""
        out = (self._seconds, self._full)
        self._seconds, self._full = 0.0, 0
        return out

    def close(self) -> None:
        """Stop timing (the hook leaves ``gc.callbacks``)."""
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)
