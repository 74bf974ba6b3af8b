"""``GcClock``: the time a rank spends in Python's garbage collector between two steps, and how
many of those collections were full ones (the step metrics' ``gc_seconds`` and
``gc_full_collections``)."""

from __future__ import annotations

import gc

from megatron_darl.loop.gc_clock import GcClock


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)  # reachable only through itself: only the collector frees it


def test_counts_full_collections_and_their_seconds_then_resets():
    clock = GcClock()
    try:
        clock.take()
        _cycles(20_000)
        gc.collect()  # full
        gc.collect(0)  # young only
        seconds, full = clock.take()
        assert full == 1
        assert 0.0 < seconds < 5.0
        assert clock.take() == (0.0, 0)  # taken: the next step starts from nothing
    finally:
        clock.close()


def test_a_closed_clock_leaves_the_collector_alone():
    clock = GcClock()
    clock.close()
    assert clock._hook not in gc.callbacks
    gc.collect()
    assert clock.take() == (0.0, 0)
    clock.close()  # twice is harmless
