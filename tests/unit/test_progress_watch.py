"""``ProgressWatch``: when the trainer's wait for groups gives up because every worker is gone.

A worker the launcher is starting again is not gone. The heartbeat thread takes the new process's
first beat while the watch reads, so the watch must not combine a loss read before that beat with
a restart count read after it (a CI run ended "every rollout worker is gone" 40 ms after the new
process beat).
"""

from __future__ import annotations

from megatron_darl.loop.endpoints import ProgressWatch, TrainerEndpoints
from megatron_darl.transport import StalenessBound
from megatron_darl.transport.store import Keys


class _BeatLandsMidRead:
    """A heartbeat whose view of rollout 0 changes after the first read: its old process was
    lost, and the new process's first beat (one more incarnation, no longer lost) lands then."""

    def __init__(self) -> None:
        self.lost, self.count, self.reads = True, 1, 0

    def _read(self) -> None:
        self.reads += 1
        if self.reads == 2:  # the heartbeat thread took the new beat after the first read
            self.lost, self.count = False, 2

    def is_lost(self, role: str, rank: int) -> bool:
        self._read()
        return self.lost

    def incarnations(self, role: str, rank: int) -> int:
        self._read()
        return self.count

    def is_alive(self, role: str, rank: int) -> bool:
        return not self.lost


def _watch(store, hb) -> ProgressWatch:
    ep = TrainerEndpoints(store=store, heartbeat=hb, hub=None, sender=None, me=None,
                          bound=StalenessBound(max_staleness=1, groups_per_step=2))
    return ProgressWatch(ep, num_workers=1, timeout_s=60.0, step=4, need=2)


def test_a_restarted_worker_whose_first_beat_lands_mid_check_is_not_gone(stores):
    server, _ = stores
    server.set(Keys.restarts("rollout", 0), "1")
    hb = _BeatLandsMidRead()
    assert _watch(server, hb).check(0) == ""  # whichever read saw the beat
    assert _watch(server, hb).check(0) == "" and not hb.lost  # and after it: alive again


def test_a_lost_worker_with_no_restart_coming_is_gone(stores):
    server, _ = stores
    hb = _BeatLandsMidRead()
    hb._read = lambda: None  # no new process: lost stays lost
    why = _watch(server, hb).check(0)
    assert why.startswith("trainer step 4: 0/2 groups; every rollout worker is gone: ") and "lost" in why, why
