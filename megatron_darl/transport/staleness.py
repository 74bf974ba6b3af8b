"""The staleness bound, enforced by rollout workers before each group (docs/architecture.md).

A worker may start a prompt group only while ``groups_started <= (t + eta + 1) * B``, with t the
published version and B the groups per step. ``groups_started`` is one counter in the store shared
by all workers, so the bound holds globally, not per worker. A reservation increments it
atomically; a reservation that would exceed the bound is returned at once. The published version
only grows, so reading it before reserving is conservative. A batch engine reserves its whole
batch at once or nothing (``try_start_batch``): a batch cut short by the bound would generate at
another batch size, which a compiled engine pays for with a recompilation.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_darl.transport.config import ChannelConfig
from megatron_darl.transport.store import ControlStore, Keys, published_version


@dataclass(frozen=True)
class StartTicket:
    """Permission to start one group."""

    version: int  # published version t read before reserving
    index: int  # this group's position in the global groups_started count (1-based)


def staleness_capacity(version: int, max_staleness: int, groups_per_step: int) -> int:
    """Largest ``groups_started`` allowed while version ``version`` is published."""
    return (version + max_staleness + 1) * groups_per_step


def _outstanding_key(worker_id: int) -> str:
    return f"stale/outstanding/{worker_id}"


def release_reservations(store: ControlStore, worker_id: int) -> int:
    """Give back the group starts a dead worker reserved but never posted; returns how many.

    Called when a worker is reported lost (by the trainer) and by a restarted worker for its
    predecessor, before it reserves anything: otherwise a dead worker's in-flight reservations
    would shrink the window for good (and with eta = 0 starve the next step). Two callers at once
    give back each reservation once (each keeps only what its own decrement took). The groups
    given back are dropped: counted in ``Keys.DROPPED``.
    """
    n = store.add(_outstanding_key(worker_id), 0)
    if n <= 0:
        return 0
    left = store.add(_outstanding_key(worker_id), -n)
    if left < 0:  # another caller took some of them first: keep only ours
        store.add(_outstanding_key(worker_id), min(n, -left))
        n -= min(n, -left)
    if n > 0:
        store.add(Keys.STARTED, -n)
        store.add(Keys.DROPPED, n)
    return n


def groups_dropped(store: ControlStore) -> int:
    """Groups started by workers that died before delivering them, over the run so far."""
    return store.add(Keys.DROPPED, 0)


def mark_delivered(store: ControlStore, worker_id: int, count: int = 1) -> None:
    """``count`` groups started by ``worker_id`` are at their hub: no longer outstanding.

    Called by whoever makes the group durable: the worker once its group sits in the store
    (``store`` transport), the hub once it received it (``dataplane``), so a worker that dies with
    groups in flight has exactly those given back by ``release_reservations``. A worker that keeps
    no count (a gate without ``worker_id``) is left at zero.
    """
    left = store.add(_outstanding_key(worker_id), -count)
    if left < 0:
        store.add(_outstanding_key(worker_id), min(count, -left))


class StalenessGate:
    """Reserve group starts against the global staleness bound.

    Args:
        worker_id: when given, the worker's reserved-but-not-posted count is kept in the store
            so that ``release_reservations`` can return it if the worker dies.
    """

    def __init__(self, store: ControlStore, cfg: ChannelConfig, worker_id: int | None = None) -> None:
        self._store, self.cfg, self.worker_id = store, cfg, worker_id

    def try_start(self) -> StartTicket | None:
        """A ticket when the bound allows one more group now, else None (never blocks)."""
        tickets = self.try_start_batch(1)
        return tickets[0] if tickets else None

    def try_start_batch(self, count: int) -> list[StartTicket]:
        """``count`` tickets when the bound allows that many more groups now, else none (never
        blocks; a reservation that overshoots is given back whole)."""
        if count < 1:
            return []
        t = published_version(self._store)
        cap = staleness_capacity(t, self.cfg.max_staleness, self.cfg.groups_per_step)
        if self.started() + count > cap:
            return []
        n = self._store.add(Keys.STARTED, count)
        if n <= cap:
            if self.worker_id is not None:
                self._store.add(_outstanding_key(self.worker_id), count)
            return [StartTicket(version=t, index=i) for i in range(n - count + 1, n + 1)]
        self._store.add(Keys.STARTED, -count)
        return []

    def posted(self, ticket: StartTicket) -> None:
        """The group started under ``ticket`` reached its hub: no longer outstanding."""
        if self.worker_id is not None:
            mark_delivered(self._store, self.worker_id)

    def started(self) -> int:
        """Groups started so far by all workers."""
        return self._store.add(Keys.STARTED, 0)
