"""The staleness bound of DESIGN.md section 3, enforced by rollout workers before each group.

A worker may start a prompt group only while ``groups_started <= (t + eta + 1) * B``, with t the
published version and B the groups per step. ``groups_started`` is one counter in the store shared
by all workers, so the bound holds globally, not per worker. A reservation increments it
atomically; a reservation that would exceed the bound is returned at once. The published version
only grows, so reading it before reserving is conservative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron_darl.transport.config import ChannelConfig
from megatron_darl.transport.store import Keys, published_version


@dataclass(frozen=True)
class StartTicket:
    """Permission to start one group."""

    version: int  # published version t read before reserving
    index: int  # this group's position in the global groups_started count (1-based)


def staleness_capacity(version: int, max_staleness: int, groups_per_step: int) -> int:
    """Largest ``groups_started`` allowed while version ``version`` is published."""
    return (version + max_staleness + 1) * groups_per_step


class StalenessGate:
    """Reserve group starts against the global staleness bound."""

    def __init__(self, store: dist.Store, cfg: ChannelConfig) -> None:
        self._store, self.cfg = store, cfg

    def try_start(self) -> StartTicket | None:
        """A ticket when the bound allows one more group now, else None (never blocks)."""
        t = published_version(self._store)
        cap = staleness_capacity(t, self.cfg.max_staleness, self.cfg.groups_per_step)
        if self.started() >= cap:
            return None
        n = self._store.add(Keys.STARTED, 1)
        if n <= cap:
            return StartTicket(version=t, index=n)
        self._store.add(Keys.STARTED, -1)
        return None

    def started(self) -> int:
        """Groups started so far by all workers."""
        return self._store.add(Keys.STARTED, 0)
