"""Sample channel pieces in one process over a real TCPStore: framing, exactly-once, resume,
back-pressure, hub sharding, the staleness gate and the config/Slurm edges."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.transport import (
    ChannelConfig, ControlPlaneConfig, GroupFrame, GroupMeta, HeartbeatConfig, SampleHub, SampleSender,
    StalenessGate, StartTicket, TransportTimeout, release_reservations, frame_group, serve_store,
    staleness_capacity, unframe_group,
)
from megatron_darl.samples import shard_of
from megatron_darl.transport.store import Keys
from tests.distributed.procs.launcher import free_port


def _group(gid: int, worker: int = 0, g: int = 3) -> SampleGroup:
    gen = torch.Generator().manual_seed(gid)
    samples = []
    for i in range(g):
        t = 1 + (gid + i) % 5
        samples.append(Sample(sample_id=gid * g + i, prompt_ids=torch.arange(4) + gid,
                              response_ids=torch.randint(0, 1000, (t,), generator=gen),
                              behavior_logprobs=-torch.rand(t, generator=gen),
                              token_versions=torch.full((t,), gid % 3), reward=float(i) / 3, truncated=i == 1))
    return SampleGroup(group_id=gid, prompt_id=gid * 7, samples=samples, worker_id=worker)


def _store(workers=1, hubs=1):
    control = ControlPlaneConfig(port=free_port(), num_workers=workers, num_hubs=hubs, store_timeout_s=10,
                                 poll_interval_s=0.001)
    return control, serve_store(control)


def test_frame_round_trip_is_bitwise():
    group = _group(11)
    got = unframe_group(GroupFrame.from_bytes(frame_group(group, GroupMeta(5, 2, 9)).to_bytes()))
    assert got.meta == GroupMeta(5, 2, 9)
    assert (got.group.group_id, got.group.prompt_id, got.group.worker_id) == (11, 77, 0)
    for a, b in zip(group.samples, got.group.samples):
        assert a.sample_id == b.sample_id and a.reward == b.reward and a.truncated == b.truncated
        for name in ("prompt_ids", "response_ids", "behavior_logprobs", "token_versions"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_malformed_frame_is_rejected():
    frame = frame_group(_group(1), GroupMeta(0, 0, 1))
    with pytest.raises(ValueError, match="frame"):
        unframe_group(GroupFrame(frame.ints[:-1], frame.floats))
    with pytest.raises(ValueError, match="magic"):
        unframe_group(GroupFrame(torch.zeros(20, dtype=torch.int64), frame.floats))


def test_shard_of_is_stable_and_balanced_even_for_worker_folded_ids():
    ids = [local * 2 + 0 for local in range(4000)]  # worker 0 of 2: only even ids
    counts = [sum(shard_of(i, 2) == h for i in ids) for h in range(2)]
    assert min(counts) > 1800 and shard_of(12345, 8) == shard_of(12345, 8)
    with pytest.raises(ValueError, match="num_shards"):
        shard_of(1, 0)


def test_exactly_once_in_order_with_a_restarted_sender():
    control, store = _store()
    cfg = ChannelConfig(max_unacked_per_hub=100)
    sender = SampleSender(store, control, cfg, 0)
    hub = SampleHub(store, control, 0)
    for gid in range(0, 10, 2):
        sender.send(_group(gid), StartTicket(0, gid + 1))
    first = hub.poll(max_groups=2)
    restarted = SampleSender(store, control, cfg, 0)  # worker restarted: resumes after posted seqs
    restarted.send(_group(100), StartTicket(0, 100))
    rest = hub.receive(4, timeout_s=5)
    got = first + rest
    assert [r.group.group_id for r in got] == [0, 2, 4, 6, 8, 100]
    assert [r.meta.seq for r in got] == list(range(6))
    assert hub.poll() == [] and not store.check([Keys.sample(0, 0, 0)])
    # a re-sent group (same id, e.g. replayed after a crash) is dropped, not delivered twice
    restarted.send(_group(4), StartTicket(0, 4))
    assert hub.poll() == [] and hub.duplicates_dropped == 1


def test_back_pressure_blocks_then_times_out_naming_the_hub():
    control, store = _store()
    sender = SampleSender(store, control, ChannelConfig(max_unacked_per_hub=2, send_timeout_s=0.3), 0)
    sender.send(_group(0), StartTicket(0, 1))
    sender.send(_group(2), StartTicket(0, 2))
    assert sender.unacked(0) == 2
    with pytest.raises(TransportTimeout, match=r"hub 0 acked nothing .*trainer 0 \(not joined\)"):
        sender.send(_group(4), StartTicket(0, 3))
    SampleHub(store, control, 0).poll()
    assert sender.unacked(0) == 0
    sender.send(_group(4), StartTicket(0, 3))


def test_back_pressure_wait_ends_on_stop_without_posting():
    control, store = _store()
    sender = SampleSender(store, control, ChannelConfig(max_unacked_per_hub=1, send_timeout_s=30.0), 0)
    sender.send(_group(0), StartTicket(0, 1))
    polls = []
    hub = sender.send(_group(2), StartTicket(0, 2), stopped=lambda: polls.append(1) or len(polls) > 3)
    assert hub is None and len(polls) == 4  # returned at the 4th poll, long before the timeout
    assert [r.group.group_id for r in SampleHub(store, control, 0).poll()] == [0]  # 2 never posted


def test_hubs_take_only_their_shard_and_never_wait_on_a_silent_worker():
    control, store = _store(workers=3, hubs=2)
    senders = [SampleSender(store, control, ChannelConfig(max_unacked_per_hub=1000), w) for w in range(2)]
    for local in range(30):
        for w, s in enumerate(senders):
            s.send(_group(local * 3 + w, worker=w), StartTicket(0, 1))
    hubs = [SampleHub(store, control, h) for h in range(2)]
    got = [hubs[h].receive(sum(shard_of(local * 3 + w, 2) == h for local in range(30) for w in range(2)), 5)
           for h in range(2)]  # worker 2 never posts anything
    for h in range(2):
        assert all(shard_of(r.group.group_id, 2) == h for r in got[h])
    assert sorted(r.group.group_id for g in got for r in g) == sorted(l * 3 + w for l in range(30) for w in range(2))
    with pytest.raises(TransportTimeout, match=r"hub 0 at step 7: 0/1 groups .*rollout 2 \(not joined\)"):
        hubs[0].receive(1, timeout_s=0.2, step=7)


def test_staleness_gate_holds_globally_under_concurrency():
    control, store = _store()
    cfg = ChannelConfig(groups_per_step=5, max_staleness=1)
    tickets: list[StartTicket] = []
    lock = threading.Lock()

    def grab():
        gate = StalenessGate(store, cfg)
        while (t := gate.try_start()) is not None:
            with lock:
                tickets.append(t)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(tickets) == staleness_capacity(0, 1, 5) == 10
    assert sorted(t.index for t in tickets) == list(range(1, 11))
    store.set(Keys.PUBLISHED, "2")
    more = StalenessGate(store, cfg)
    assert [more.try_start().index for _ in range(10)] == list(range(11, 21)) and more.try_start() is None


def test_a_dead_workers_reservations_are_given_back():
    control, store = _store()
    cfg = ChannelConfig(groups_per_step=3, max_staleness=0)
    gate = StalenessGate(store, cfg, worker_id=1)
    tickets = [gate.try_start() for _ in range(3)]
    assert gate.try_start() is None
    gate.posted(tickets[0])  # one reached its hub; two die with the worker
    assert release_reservations(store, 1) == 2 and gate.started() == 1
    assert release_reservations(store, 1) == 0
    assert [gate.try_start().index for _ in range(2)] == [2, 3] and gate.try_start() is None


def test_config_edges():
    with pytest.raises(ValueError, match="num_workers"):
        ControlPlaneConfig(num_workers=0)
    with pytest.raises(ValueError, match="max_staleness"):
        ChannelConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        HeartbeatConfig(interval_s=1.0, timeout_s=1.5)
