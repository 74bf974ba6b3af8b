"""``loop.wait_for_bound``: a step waits until every start the staleness bound allows has arrived.

The need is counted on the trainer (``Backlog`` with ``ahead = eta``: ``(eta + 1) * B`` untrained
groups held, i.e. ``(t + eta + 1) * B`` received by step t), and the ledger says when no more can
come (``bound_filled``: a batch engine reserves whole batches, so the cap may be out of reach).
The ledger counts a group delivered just before its hub's queue holds it, so its verdict is acted
on only after a later poll of a settled hub (``SampleHub.settled``).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from megatron_darl.loop.config import LoopConfig
from megatron_darl.loop.endpoints import Backlog, ProgressWatch, TrainerEndpoints, receive_groups
from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.transport import (
    ChannelConfig, SampleHub, SampleSender, StalenessBound, StalenessGate, Topology, links,
)
from megatron_darl.transport.staleness import bound_filled, give_back_degenerate, mark_delivered


def test_the_option_is_off_by_default():
    assert LoopConfig().wait_for_bound is False


def test_the_need_fills_the_bound_then_b_a_step():
    backlog = Backlog(per_step=8, ahead=3)  # eta 3
    assert (backlog.need(), backlog.floor()) == (32, 8)  # step 0: (0 + 3 + 1) * 8 received
    backlog.took(32)
    assert (backlog.surplus, backlog.need(), backlog.floor()) == (24, 8, 0)  # held 24: 8 more reach 40
    backlog.took(8)
    assert backlog.need() == 8
    backlog.took(5)  # the wait ended early (the ledger filled): the next one makes up for it
    assert (backlog.surplus, backlog.need(), backlog.floor()) == (21, 11, 0)
    resumed = Backlog(per_step=8, ahead=3, surplus=max(0, 70 - 5 * 8))  # trainer_loop's restore at step 5
    assert resumed.need() == (5 + 3 + 1) * 8 - 70 == 2
    sync = Backlog(per_step=8, ahead=0, surplus=3)  # eta 0: the same need as without the option
    assert sync.need() == sync.floor() == 5


def test_the_ledger_is_filled_when_no_whole_batch_fits_and_none_is_in_flight(stores):
    server, client = stores
    bound = StalenessBound(max_staleness=1, groups_per_step=4)
    assert not bound_filled(server, bound)  # no worker yet: never filled
    gate = StalenessGate(client, bound, worker_id=0)
    assert not bound_filled(server, bound)  # joined, nothing reserved: room 8
    assert len(gate.try_start_batch(3)) == 3 and len(gate.try_start_batch(3)) == 3
    assert gate.try_start_batch(3) == []  # room 2 of cap 8: a batch of 3 never fits at version 0
    assert not bound_filled(server, bound)  # 6 in flight
    assert mark_delivered(server, 0, 5, generation=gate.generation) and not bound_filled(server, bound)
    assert mark_delivered(server, 0, 1, generation=gate.generation) and bound_filled(server, bound)
    give_back_degenerate(server, [SimpleNamespace()])  # room 3: a replacement batch fits again
    assert not bound_filled(server, bound)
    assert len(gate.try_start_batch(3)) == 3 and mark_delivered(server, 0, 3, generation=gate.generation)
    assert bound_filled(server, bound)  # started 8 = the cap
    server.ledger.call("publish", version=1)
    assert not bound_filled(server, bound)  # cap 12
    assert gate.try_start() is not None  # single starts: filled only at the cap itself
    assert mark_delivered(server, 0, 1, generation=gate.generation) and not bound_filled(server, bound)


def test_a_batch_engine_takes_the_given_back_starts_the_trainer_waits_for(stores):
    """Sync (eta 0) with a whole-batch engine of B and degenerate groups dropped: the replacements
    come as a smaller batch, since no publish makes room before the trainer has its B groups (the
    run deadlocked: 9 of 16 trained, the worker waiting for room for 16)."""
    server, client = stores
    bound = StalenessBound(max_staleness=0, groups_per_step=4)
    gate = StalenessGate(client, bound, worker_id=0)
    first = gate.try_start_batch(4)
    assert [t.index for t in first] == [1, 2, 3, 4] and mark_delivered(server, 0, 4, generation=gate.generation)
    give_back_degenerate(server, [SimpleNamespace()] * 3)
    assert not bound_filled(server, bound)  # room 3, all of it given back: a worker can take it
    again = gate.try_start_batch(4)
    assert [t.index for t in again] == [2, 3, 4]  # the three starts, not a batch of four
    assert gate.try_start_batch(4) == [] and mark_delivered(server, 0, 3, generation=gate.generation)
    assert bound_filled(server, bound)  # the cap reached, nothing given back
    give_back_degenerate(server, [SimpleNamespace()])
    server.ledger.call("publish", version=1)  # cap 8, started 3: room for a whole batch again
    assert len(gate.try_start_batch(4)) == 4  # a whole batch takes the given-back start with it
    assert gate.try_start_batch(4) == []  # room 1, nothing given back left: wait for a publish
    assert mark_delivered(server, 0, 4, generation=gate.generation) and bound_filled(server, bound)


def _group(group_id: int) -> SampleGroup:
    samples = [Sample(sample_id=group_id * 10 + i, prompt_ids=torch.tensor([1]), response_ids=torch.tensor([5, 6]),
                      behavior_logprobs=torch.zeros(2), token_versions=torch.zeros(2, dtype=torch.long), reward=r)
               for i, r in enumerate([0.0, 1.0])]
    return SampleGroup(group_id=group_id, prompt_id=group_id, samples=samples, worker_id=0, worker_index=group_id)


class _Hub:
    """Hands out one prepared batch of groups per poll (a stand-in for ``SampleHub``)."""

    def __init__(self, batches):
        self.batches, self.hub = list(batches), 0

    def settled(self):
        return True

    def poll(self):
        return [SimpleNamespace(group=g) for g in (self.batches.pop(0) if self.batches else [])]


class _Handover(_Hub):
    """A hub whose link hands over ``groups`` in three phases, one a poll: in flight, counted
    delivered by the ledger but not yet in the hub's queue (unsettled), in it."""

    def __init__(self, groups):
        super().__init__([groups])
        self.phase = 0

    def settled(self):
        return self.phase != 1

    def poll(self):
        got = super().poll() if self.phase == 2 else []
        self.phase += 1
        return got


def _receive(store, batches, need, floor, filled, hub=None):
    hb = SimpleNamespace(is_lost=lambda *a: False, is_alive=lambda *a: True, incarnations=lambda *a: 1)
    ep = TrainerEndpoints(store=store, heartbeat=hb, hub=hub or _Hub(batches), sender=None, me=None,
                          bound=StalenessBound(max_staleness=4, groups_per_step=1))
    return receive_groups(ep, SimpleNamespace(rank=0, dp_sum=lambda t: t), need, timeout_s=5.0, step=0, poll_s=0.0,
                          num_workers=1, filled=filled, floor=floor)


def test_a_filled_ledger_ends_the_wait_once_the_step_has_its_b(stores):
    server, _ = stores
    asks = iter([False, False, True, True, True])  # rank 0 asks after each poll, acts after the next
    got = _receive(server, [[_group(1)], [_group(2)], [_group(3)], [_group(4)], [_group(5)]], need=8, floor=4,
                   filled=lambda: next(asks))
    assert got.total == 4  # filled from the third ask on, but the step waited for its floor of 4
    early = _receive(server, [[_group(1), _group(2)], [_group(3)]], need=8, floor=0, filled=lambda: True)
    assert early.total == 3  # a backlog that holds B already: filled ends the wait at the second poll
    full = _receive(server, [[_group(i) for i in range(8)]], need=8, floor=8, filled=lambda: False)
    assert full.total == 8  # the need reached ends it whatever the ledger says


def test_a_verdict_counts_only_groups_a_later_poll_of_a_settled_hub_holds(stores):
    """The worker's last two groups: the hub's link has the ledger count them delivered, then hands
    them to the hub's queue. A verdict asked in between is filled while the poll holds nothing:
    acted on at once, a step whose backlog holds its B (floor 0) would train none of them, and which
    groups a step trains would hang on that race."""
    server, _ = stores
    hub = _Handover([_group(1), _group(2)])
    got = _receive(server, [], need=4, floor=0, filled=lambda: hub.phase >= 1, hub=hub)
    assert [g.group_id for g in got.groups] == [1, 2] and got.total == 2 and hub.phase == 3  # three polls


def test_a_real_hub_is_unsettled_between_the_ledgers_count_and_the_handover(control, stores, monkeypatch):
    """The real link over the real ledger, its handover held after the ledger's ``arrive``: the
    bound is filled while the hub's poll holds nothing, and the hub says so (not settled)."""
    server, client = stores
    counted, release = threading.Event(), threading.Event()
    real = links.mark_delivered

    def slow_handover(*args, **kwargs):
        ok = real(*args, **kwargs)
        counted.set()
        release.wait(10)
        return ok

    monkeypatch.setattr(links, "mark_delivered", slow_handover)
    bound, topo = StalenessBound(max_staleness=0, groups_per_step=1), Topology(workers=1)
    cfg = ChannelConfig(transport="store", connect_timeout_s=10.0, transfer_timeout_s=10.0)
    gate = StalenessGate(client, bound, worker_id=0)
    hub = SampleHub(server, control, cfg, topo, 0)
    sender = SampleSender(client, control, cfg, topo, 0, gate=gate)
    try:
        assert hub.settled() and not bound_filled(server, bound)
        (ticket,) = gate.try_start_batch(1)
        sender.send(_group(0), ticket)
        assert counted.wait(10)
        assert bound_filled(server, bound) and not hub.settled() and hub.poll() == []  # counted, not there
        release.set()
        deadline = time.monotonic() + 10
        got = []
        while not (got and hub.settled()) and time.monotonic() < deadline:  # the link clears its flag after
            got += hub.poll()                                                # handing the group over
            time.sleep(0.005)
        assert [r.group.group_id for r in got] == [0] and hub.settled()
    finally:
        release.set()
        sender.close()
        hub.close()


def test_the_timeout_names_the_bound(stores):
    server, _ = stores
    hb = SimpleNamespace(is_lost=lambda *a: False, is_alive=lambda *a: True, incarnations=lambda *a: 1)
    ep = TrainerEndpoints(store=server, heartbeat=hb, hub=None, sender=None, me=None,
                          bound=StalenessBound(max_staleness=4, groups_per_step=1))
    watch = ProgressWatch(ep, num_workers=1, timeout_s=0.01, step=3, need=32, bound=True)
    watch.states = lambda: "rollout 0: alive"
    assert watch.check(20) == ""  # groups arrived: the rollout side is alive
    time.sleep(0.05)  # then nothing for longer than the timeout
    assert watch.check(20).startswith("trainer step 3: 20/32 groups (loop.wait_for_bound: every start the "
                                      "staleness bound allows); no new group for")


def test_the_bound_counts_from_the_trainers_version_before_the_workers_ack_it(stores):
    """A step that starts before the workers acked its publish still waits for what that publish
    allows: filled is judged under the trainer's version (the paper presets' runs otherwise
    trained 0 or 2 groups at a step by which side of the ack the receive fell)."""
    server, client = stores
    bound = StalenessBound(max_staleness=0, groups_per_step=2)
    gate = StalenessGate(client, bound, worker_id=0)
    assert len(gate.try_start_batch(2)) == 2 and mark_delivered(server, 0, 2, generation=gate.generation)
    assert bound_filled(server, bound, version=0)  # cap 2 reached under version 0
    assert not bound_filled(server, bound, version=1)  # published, not yet acked: 2 more to come
    assert gate.try_start_batch(2) == []  # the workers still see cap 2 until they ack
    server.ledger.call("publish", version=1)
    assert len(gate.try_start_batch(2)) == 2 and mark_delivered(server, 0, 2, generation=gate.generation)
    assert bound_filled(server, bound, version=1)
