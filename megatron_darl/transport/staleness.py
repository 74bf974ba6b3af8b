"""The staleness bound: enforced by rollout workers before each group, and checked again by the trainer.

A worker may start a prompt group only while ``groups_started <= (t + eta + 1) * B``, with t the
published version and B the groups per step. ``groups_started`` is one counter shared by all
workers, so the bound holds globally, not per worker. It lives in the run's ledger on trainer
rank 0 (``ledger.py``), which takes only requests signed with the run's secret, so no process
outside the run can move it. A reservation is one atomic ledger request: granted whole, or not
at all. A batch engine reserves its whole batch at once or nothing (``try_start_batch``): a batch
cut short by the bound would generate at another batch size, which a compiled engine pays for
with a recompilation. The one exception is starts given back (below): a batch of as many of
those as the bound has room for is granted, or the replacements the trainer waits for under
``replay.fill_batch`` would wait for room that no publish brings (the trainer publishes only
once it has them).

Generations: every worker process joins under a new generation number, and every start it
reserves and every group it sends carries it. A worker declared lost (heartbeat timeout) has its
generation fenced and its outstanding starts given back (``release_reservations``), so the
others may start groups in their place. If it was only frozen and comes back, it holds starts it
no longer owns: its reservations under the fenced generation are refused (it joins again, as a
new generation, and goes on), and its groups of that generation are refused at the hub and
counted (``Keys.FENCED``), never trained: the groups started in their place already are. A
restarted process (the same worker id) joins the same way, which fences its predecessor.

The bound on starts is a bound on what is generated; the trainer checks what it trains.
``admit_fresh`` is called where groups enter the trainer: a group whose oldest token is more
than ``max_staleness`` versions behind the trainer is not trained, its start is given back and
it is counted (``Keys.REFUSED``). A worker paused, frozen or slow in ways the gate cannot see
costs that group, never the bound.

Dynamic sampling (``replay.fill_batch``, DAPO's "filter groups and refill"): the hub drops a group
whose rewards are all equal (zero advantage, never selected) right after ``admit_fresh`` and
gives its start back the same way, counted in ``Keys.DEGENERATE`` (``give_back_degenerate``), so
the workers may start a replacement and a step's B groups are B trainable ones. The bound then
counts trainable groups and groups in flight; the trainer's check is unchanged. Both give-backs
are of groups a hub accepted (``mark_delivered``): a fenced generation's groups are refused before
they get there and gain nothing, and a start is given back once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from megatron_darl.samples import SampleGroup
from megatron_darl.transport.ledger import call_once, outstanding_key
from megatron_darl.transport.shape import StalenessBound
from megatron_darl.transport.store import ControlStore, Keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartTicket:
    """Permission to start one group."""

    version: int  # published version t when the start was reserved
    index: int  # this group's position in the global groups_started count (1-based)
    generation: int = 0  # the reserving worker's generation (0: a gate that keeps no count)


def release_reservations(store: ControlStore, worker_id: int) -> int:
    """Fence a lost worker's generation and give back the starts it reserved but never delivered;
    returns how many (counted in ``Keys.DROPPED``).

    Called by the trainer when a worker is reported lost: otherwise a dead worker's in-flight
    reservations would shrink the window for good (and with eta = 0 starve the next step). Once
    fenced, what that generation still does is refused (module docstring); a second call gives
    back nothing. Sent again as the same request when its answer is lost (``call_once``). A try
    that reaches the ledger only after a restarted process of the worker joined fences that
    process instead: its next reservation is refused and it joins again, so the bound holds.
    """
    return int(call_once(store.ledger, "fence", worker=int(worker_id))["released"])


def bound_filled(store: ControlStore, bound: StalenessBound, version: int = 0) -> bool:
    """True when no live worker can start a group under the trainer's ``version`` and none has one
    in flight: every start the bound allows then has reached a hub, as near its cap as the workers'
    reservation sizes reach (``loop.wait_for_bound`` stops waiting then). Counting from the
    trainer's version, not the one the workers acked, keeps a step from ending before the ack of
    its publish lands: what a step waits for does not depend on that race."""
    return bool(store.ledger.call("filled", max_staleness=bound.max_staleness,
                                  groups_per_step=bound.groups_per_step, version=int(version))["filled"])


def groups_dropped(store: ControlStore) -> int:
    """Groups started by workers that were lost or replaced before delivering them, so far."""
    return store.add(Keys.DROPPED, 0)


def groups_refused(store: ControlStore) -> dict[str, int]:
    """Groups refused so far: sent by a fenced generation (``fenced``), over the bound when they
    reached the trainer (``stale``), or dropped there as degenerate (``degenerate``,
    ``replay.fill_batch``)."""
    return {"fenced": store.add(Keys.FENCED, 0), "stale": store.add(Keys.REFUSED, 0),
            "degenerate": store.add(Keys.DEGENERATE, 0)}


def mark_delivered(store: ControlStore, worker_id: int, count: int = 1, generation: int = 0) -> bool:
    """``count`` groups of ``worker_id``'s ``generation`` reached their hub: no longer outstanding.

    Called by the hub when it takes them, so a worker that dies with groups in flight has exactly
    those given back by ``release_reservations``. False when that generation is fenced: its starts
    were given back already, so the groups are refused (counted in ``Keys.FENCED``); the caller
    must not hand them on. Generation 0 (a gate without ``worker_id``) keeps no count.
    """
    return bool(call_once(store.ledger, "arrive", worker=int(worker_id), generation=int(generation),
                          count=int(count))["accepted"])


def admit_fresh(store: ControlStore, groups: Sequence[SampleGroup], version: int, max_staleness: int,
                who: str = "trainer") -> list[SampleGroup]:
    """The ``groups`` the trainer at ``version`` may train: those whose oldest token is at most
    ``max_staleness`` versions old. The others are refused: logged, their starts given back and
    counted in ``Keys.REFUSED``. A group without tokens has no age and is kept."""
    fresh, stale = [], []
    for g in groups:
        (fresh if g.behavior_version < 0 or version - g.behavior_version <= max_staleness else stale).append(g)
    if stale:
        total = store.ledger.call("refuse", count=len(stale), why="stale")["refused"]
        for g in stale:
            log.warning("%s at version %d: refused group %d of rollout %d: its oldest token is of version "
                        "%d, %d versions old (max_staleness %d); not trained, its start given back "
                        "(%d refused so far)", who, version, g.group_id, g.worker_id, g.behavior_version,
                        version - g.behavior_version, max_staleness, total)
    return fresh


def give_back_degenerate(store: ControlStore, groups: Sequence[SampleGroup]) -> int:
    """Give back the starts of ``groups``, delivered groups whose rewards are all equal that the
    hub drops under ``replay.fill_batch`` (never trained: zero advantage), so workers may start
    replacements; counted in ``Keys.DEGENERATE``. Returns that count so far (``0`` for no groups:
    no ledger request). The same give-back as ``admit_fresh``'s, under its own key."""
    if not groups:
        return 0
    return int(store.ledger.call("refuse", count=len(groups), why="degenerate")["refused"])


class StalenessGate:
    """Reserve group starts against the global staleness bound.

    Args:
        worker_id: when given, the gate joins the ledger as that worker's next generation (which
            fences its predecessor's and gives back the starts it left outstanding: ``dropped``),
            and its reservations are counted as outstanding until their groups reach a hub.
    """

    def __init__(self, store: ControlStore, bound: StalenessBound, worker_id: int | None = None) -> None:
        self._store, self.bound, self.worker_id = store, bound, worker_id
        self.generation, self.dropped = 0, 0
        if worker_id is not None:
            self.dropped = self._join()

    def _join(self) -> int:
        got = self._store.ledger.call("join", worker=int(self.worker_id))
        self.generation = int(got["generation"])
        return int(got["released"])

    def try_start(self) -> StartTicket | None:
        """A ticket when the bound allows one more group now, else None (never blocks)."""
        tickets = self.try_start_batch(1)
        return tickets[0] if tickets else None

    def try_start_batch(self, count: int) -> list[StartTicket]:
        """``count`` tickets when the bound allows that many more groups now, else as many as it
        has room for among the starts given back, else none (never waits for room). A gate whose
        generation was fenced joins again first (logged)."""
        if count < 1:
            return []
        got = self._reserve(count)
        if got.get("fenced"):
            fenced = self.generation
            self._join()
            log.warning("rollout %d: the trainer declared generation %d lost (fenced) and gave back its "
                        "starts: its groups still in flight will be refused at the hub; going on as "
                        "generation %d", self.worker_id, fenced, self.generation)
            got = self._reserve(count)
        if "last" not in got:
            return []
        n, t, count = int(got["last"]), int(got["version"]), int(got["count"])
        return [StartTicket(version=t, index=i, generation=self.generation) for i in range(n - count + 1, n + 1)]

    def _reserve(self, count: int) -> dict:
        return self._store.ledger.call(
            "reserve", worker=-1 if self.worker_id is None else int(self.worker_id), generation=self.generation,
            count=int(count), max_staleness=self.bound.max_staleness, groups_per_step=self.bound.groups_per_step)

    def posted(self, ticket: StartTicket) -> bool:
        """The group started under ``ticket`` reached its hub (``mark_delivered``)."""
        if self.worker_id is None:
            return True
        return mark_delivered(self._store, self.worker_id, 1, ticket.generation)

    def started(self) -> int:
        """Groups started so far by all workers."""
        return self._store.add(Keys.STARTED, 0)

    def outstanding(self) -> int:
        """Starts of this worker's live generation whose groups have not reached a hub."""
        return 0 if self.worker_id is None else self._store.add(outstanding_key(self.worker_id), 0)
