"""Sample channel in one process over a real TCPStore and real gloo pair groups (threads): framing,
exactly-once, resume, back-pressure, hub sharding, a slow or dead worker next to a live one, the
staleness gate and the config edges. Both transports (data plane, store) where they differ."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_darl.samples import Sample, SampleGroup, shard_of
from megatron_darl.transport import (
    ChannelConfig, ControlPlaneConfig, GroupFrame, GroupMeta, HeartbeatConfig, SampleHub, SampleSender,
    StalenessBound, StalenessGate, StartTicket, Topology, TransportTimeout, frame_group, release_reservations,
    serve_store, unframe_group,
)
from megatron_darl.transport.frames import split_frames
from megatron_darl.transport.links import Header
from megatron_darl.transport.process_group import build_group
from megatron_darl.transport.store import ControlStore, Keys, publish_version
from tests.distributed.procs.launcher import free_port

TRANSPORTS = ("dataplane", "store")


def _group(gid: int, worker: int = 0, g: int = 3, index: int = -1) -> SampleGroup:
    gen = torch.Generator().manual_seed(gid)
    samples = []
    for i in range(g):
        t = 1 + (gid + i) % 5
        samples.append(Sample(sample_id=gid * g + i, prompt_ids=torch.arange(4) + gid,
                              response_ids=torch.randint(0, 1000, (t,), generator=gen),
                              behavior_logprobs=-torch.rand(t, generator=gen),
                              token_versions=torch.full((t,), gid % 3), reward=float(i) / 3, truncated=i == 1))
    return SampleGroup(group_id=gid, prompt_id=gid * 7, samples=samples, worker_id=worker, worker_index=index)


def _store(workers=1, hubs=1):
    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10, poll_interval_s=0.001)
    return control, serve_store(control), Topology(workers=workers, hubs=hubs)


def _cfg(transport: str, **kw) -> ChannelConfig:
    kw.setdefault("connect_timeout_s", 10.0)
    kw.setdefault("transfer_timeout_s", 10.0)
    return ChannelConfig(transport=transport, **kw)


def _join_pair(store, hub: int, worker: int, epoch: int):
    """A worker's side of a pair, as ``OutLink`` builds it: the hub's word first, then the group."""
    ready = Keys.sample_pair_ready(hub, worker, epoch)
    store.wait([ready], 10.0, "the hub's word")
    store.delete_key(ready)
    return build_group(store, f"ch/{hub}/{worker}/{epoch}", 1, 2, "gloo", 10.0)


def _take(hub: SampleHub, n: int, timeout_s: float = 20.0) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n:
        out += hub.poll(n - len(out))
        assert time.monotonic() < deadline, f"{len(out)}/{n} groups after {timeout_s} s"
        time.sleep(0.002)
    return out


def test_frame_round_trip_is_bitwise():
    group = _group(11, worker=1, index=5)
    for got in (unframe_group(GroupFrame.from_bytes(frame_group(group, GroupMeta(5, 2, 9)).to_bytes())),
                unframe_group(GroupFrame.from_buffer(frame_group(group, GroupMeta(5, 2, 9)).to_buffer()))):
        assert got.meta == GroupMeta(5, 2, 9)
        assert (got.group.group_id, got.group.prompt_id, got.group.worker_id, got.group.worker_index) == (11, 77, 1, 5)
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
    with pytest.raises(ValueError, match="truncated"):
        GroupFrame.from_buffer(frame.to_buffer()[:-1])
    old = GroupFrame(frame.ints.clone(), frame.floats)
    old.ints[1] = 1  # a format-1 sender's frame (no worker_index): refused, not misread
    with pytest.raises(ValueError, match="format version"):
        unframe_group(old)


def test_shard_of_deals_one_workers_folded_ids_evenly_over_the_hubs():
    ids = [local * 2 + 0 for local in range(4000)]  # worker 0 of 2: only even ids
    assert [sum(shard_of(i, 2, 2) == h for i in ids) for h in range(2)] == [2000, 2000]
    assert [sum(shard_of(i, 3, 2) == h for i in ids[:7]) for h in range(3)] == [3, 2, 2]
    with pytest.raises(ValueError, match="num_shards"):
        shard_of(1, 0, 1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exactly_once_in_order_with_a_restarted_sender(transport):
    control, store, topo = _store()
    cfg = _cfg(transport, max_unacked_per_hub=100)
    sender = SampleSender(store, control, cfg, topo, 0)
    hub = SampleHub(store, control, cfg, topo, 0)
    for gid in range(0, 10, 2):
        sender.send(_group(gid), StartTicket(0, gid + 1))
    first = _take(hub, 2)
    if transport == "dataplane":  # a restart resumes after the acked groups: let them arrive
        assert sender.flush(20) == 0
    sender.close()
    restarted = SampleSender(store, control, cfg, topo, 0)
    restarted.send(_group(100), StartTicket(0, 100))
    got = first + _take(hub, 4)
    assert [r.group.group_id for r in got] == [0, 2, 4, 6, 8, 100]
    assert [r.meta.seq for r in got] == list(range(6))
    assert restarted.flush(20) == 0 and hub.poll() == [] and _gone(store, Keys.sample(0, 0, 5))
    # a re-sent group (same id, e.g. replayed after a crash) is dropped, not delivered twice
    restarted.send(_group(4), StartTicket(0, 4))
    assert restarted.flush(20) == 0 and hub.poll() == [] and hub.duplicates_dropped == 1
    restarted.close()
    hub.close()


def _gone(store, key: str, timeout_s: float = 5.0) -> bool:
    """Whether ``key`` is deleted within ``timeout_s`` (the hub acks a header, then deletes it)."""
    deadline = time.monotonic() + timeout_s
    while store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class _ConsumedWhileLooking:
    """The store as a restarting worker sees it while the hub takes its posted groups: the first
    header check finds the hub has just acked and deleted all of them (what a hub link does)."""

    def __init__(self, store, posted: int) -> None:
        self._store, self._posted, self.checks = store, posted, 0

    def check(self, keys):
        if self.checks == 0:
            self._store.set(Keys.sample_ack(0, 0), str(self._posted - 1))
            for seq in range(self._posted):
                self._store.delete_key(Keys.sample(0, 0, seq))
        self.checks += 1
        return self._store.check(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_restarted_store_sender_never_reuses_a_seq_the_hub_took_while_it_looked():
    """A restart scans past its earlier incarnation's posted headers; a header the hub consumed
    during the scan is missing too, and must not be taken for a free seq (its group would sit
    under a seq the hub has passed, never delivered: a full test run once saw 3 of 4 groups)."""
    control, store, topo = _store()
    cfg = _cfg("store", max_unacked_per_hub=100)
    first = SampleSender(store, control, cfg, topo, 0)
    for gid in range(0, 6, 2):
        first.send(_group(gid), StartTicket(0, gid + 1))
    first.close()
    assert store.check([Keys.sample(0, 0, s) for s in range(3)])
    racing = _ConsumedWhileLooking(store, posted=3)
    restarted = SampleSender(racing, control, cfg, topo, 0)
    assert racing.checks >= 2 and restarted._next[0] == 3  # after the consumed seqs 0-2, not 0
    restarted.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_back_pressure_blocks_then_times_out_naming_the_hub(transport):
    control, store, topo = _store()
    cfg = _cfg(transport, max_unacked_per_hub=2, send_timeout_s=0.3)
    sender = SampleSender(store, control, cfg, topo, 0)
    sender.send(_group(0), StartTicket(0, 1))
    sender.send(_group(2), StartTicket(0, 2))
    assert sender.unacked(0) == 2
    with pytest.raises(TransportTimeout, match=r"hub 0 acked nothing .*trainer 0 \(not joined\)"):
        sender.send(_group(4), StartTicket(0, 3))
    hub = SampleHub(store, control, cfg, topo, 0)  # the hub comes: its link takes both, then room again
    assert [r.group.group_id for r in _take(hub, 2)] == [0, 2]
    assert sender.flush(20) == 0
    sender.send(_group(4), StartTicket(0, 3))
    assert [r.group.group_id for r in _take(hub, 1)] == [4]
    sender.close()
    hub.close()


def test_back_pressure_holds_across_a_sender_restart():
    """A restarted store-transport sender goes past the groups it posted and nobody consumed;
    they still count against ``max_unacked_per_hub`` (the sender caches the last ack it read)."""
    control, store, topo = _store()
    cfg = _cfg("store", max_unacked_per_hub=2, send_timeout_s=0.3)
    first = SampleSender(store, control, cfg, topo, 0)
    first.send(_group(0), StartTicket(0, 1))
    first.send(_group(2), StartTicket(0, 2))
    first.close()
    restarted = SampleSender(store, control, cfg, topo, 0)
    with pytest.raises(TransportTimeout, match=r"hub 0 acked nothing .*\(2 groups unacked\)"):
        restarted.send(_group(4), StartTicket(0, 3))
    assert not store.check([Keys.sample(0, 0, 2)])
    restarted.close()


def test_back_pressure_wait_ends_on_stop_without_sending():
    control, store, topo = _store()
    cfg = _cfg("dataplane", max_unacked_per_hub=1, send_timeout_s=30.0)
    sender = SampleSender(store, control, cfg, topo, 0)
    sender.send(_group(0), StartTicket(0, 1))
    polls = []
    hub = sender.send(_group(2), StartTicket(0, 2), stopped=lambda: polls.append(1) or len(polls) > 3)
    assert hub is None and len(polls) == 4  # returned at the 4th poll, long before the timeout
    receiver = SampleHub(store, control, cfg, topo, 0)
    assert [r.group.group_id for r in _take(receiver, 1)] == [0]
    time.sleep(0.3)
    assert receiver.poll() == []  # 2 was never sent
    sender.close()
    receiver.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a device whose setup fails in the link thread")
def test_a_link_that_fails_at_setup_ends_the_next_send_not_the_send_timeout():
    # found on the GPU machine: a bare "cuda" device made the link thread's set_device raise before
    # its error was recorded, and the worker waited out send_timeout_s while the trainer waited too
    control, store, topo = _store()
    cfg = _cfg("dataplane", max_unacked_per_hub=1, send_timeout_s=60.0)
    sender = SampleSender(store, control, cfg, topo, 0, device=torch.device("cuda", 0))  # no CUDA here: setup fails
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"rollout 0: the channel to hub 0 .* failed: "):
        sender.send(_group(0), StartTicket(0, 1))  # the first, or at the latest the one back-pressure holds
        sender.send(_group(2), StartTicket(0, 2))
    assert time.monotonic() - t0 < 5.0


def test_a_bare_cuda_device_is_given_its_index():
    from megatron_darl.transport.cuda_ipc import indexed

    assert indexed(torch.device("cpu")) == torch.device("cpu")
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    if torch.cuda.is_available():
        assert indexed(torch.device("cuda")) == torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_hubs_take_only_their_shard_and_never_wait_on_a_silent_worker(transport):
    control, store, topo = _store(workers=3, hubs=2)
    cfg = _cfg(transport, max_unacked_per_hub=1000)
    hubs = [SampleHub(store, control, cfg, topo, h) for h in range(2)]
    senders = [SampleSender(store, control, cfg, topo, w) for w in range(2)]  # worker 2 never sends
    for local in range(30):
        for w, s in enumerate(senders):
            s.send(_group(local * 3 + w, worker=w), StartTicket(0, 1))
    got = [_take(hubs[h], sum(shard_of(local * 3 + w, 2, 3) == h for local in range(30) for w in range(2)))
           for h in range(2)]
    for h in range(2):  # each worker's groups dealt round-robin (worker count 3, silent one included)
        assert all(shard_of(r.group.group_id, 2, 3) == h for r in got[h]) and len(got[h]) == 30
    assert sorted(r.group.group_id for g in got for r in g) == sorted(l * 3 + w for l in range(30) for w in range(2))
    start = time.monotonic()
    assert hubs[0].poll() == [] and time.monotonic() - start < 1.0  # nothing there: no wait (a wait: 10 s)
    for x in senders + hubs:
        x.close()


def test_a_slow_worker_mid_transfer_does_not_hold_up_another():
    """Worker 1 posts a header, joins its pair and then stalls, before sending the payload, until
    worker 0's groups to the same hub have arrived (within the hub's transfer timeout, 10 s)."""
    control, store, topo = _store(workers=2)
    cfg = _cfg("dataplane", max_unacked_per_hub=100)
    hub = SampleHub(store, control, cfg, topo, 0)
    slow = frame_group(_group(1, worker=1), GroupMeta(0, 0, 1)).to_buffer()
    sent, release = {}, threading.Event()

    def stalled_worker():
        epoch = store.add(Keys.sample_epoch(0, 1), 1)
        store.set(Keys.sample(0, 1, 0), Header(0, epoch, "gloo", slow.numel(), 1).to_bytes())
        pair = _join_pair(store, 0, 1, epoch)
        release.wait(8.0)
        sent["at"] = time.monotonic()
        pair.pg.send([slow], 0, 0).wait()

    thread = threading.Thread(target=stalled_worker)
    thread.start()
    time.sleep(0.5)  # worker 1's link is now waiting in its receive
    fast = SampleSender(store, control, cfg, topo, 0)
    for gid in range(0, 10, 2):
        fast.send(_group(gid), StartTicket(0, 1))
    got = _take(hub, 5, timeout_s=7.0)  # all of worker 0's while worker 1's transfer is open
    assert sorted(r.group.group_id for r in got) == [0, 2, 4, 6, 8] and "at" not in sent
    release.set()
    late = _take(hub, 1, timeout_s=10)
    assert late[0].group.group_id == 1 and late[0].group.worker_id == 1
    thread.join(10)
    fast.close()
    hub.close()


def test_groups_queued_behind_a_transfer_cross_as_one_and_arrive_in_order():
    """The worker sends 6 groups before the hub exists: its link waits to build the pair with the
    first one posted, the rest queue behind it and cross in one transfer; the hub gets all six in
    seq order, bitwise, in fewer transfers than groups, and acks the last seq."""
    control, store, topo = _store()
    cfg = _cfg("dataplane", max_unacked_per_hub=100)
    sender = SampleSender(store, control, cfg, topo, 0)
    groups = [_group(gid) for gid in range(0, 12, 2)]
    for g in groups:
        sender.send(g, StartTicket(0, 1))
    time.sleep(0.3)
    hub = SampleHub(store, control, cfg, topo, 0)
    got = _take(hub, 6)
    assert [r.meta.seq for r in got] == list(range(6))
    for g, r in zip(groups, got):
        assert r.group.group_id == g.group_id
        for a, b in zip(g.samples, r.group.samples):
            assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.behavior_logprobs, b.behavior_logprobs)
    assert 1 <= hub.transfers_received < 6
    assert sender.flush(10) == 0 and store.read(Keys.sample_ack(0, 0)) == b"5"
    sender.close()
    hub.close()


def test_frames_of_a_transfer_are_split_by_their_size_prefixes():
    frames = [frame_group(_group(gid), GroupMeta(gid, 0, 1)).to_buffer() for gid in range(3)]
    joined = torch.cat(frames)
    out = split_frames(joined, 3)
    assert [int(unframe_group(f).group.group_id) for f in out] == [0, 1, 2]
    with pytest.raises(ValueError, match="bytes after the 2 frames"):
        split_frames(joined, 2)
    with pytest.raises(ValueError, match="truncated group frame"):
        split_frames(joined[:-5], 3)


class _OneTimeoutEach:
    """A store that misses one deadline per request kind in the hub's link threads: the first
    header read (nothing done), the first ack's set and the first header delete (both done, their
    replies lost), as ``ControlStore`` raises past a call's deadline."""

    def __init__(self, monkeypatch) -> None:
        self.fired: list[str] = []
        for name, before in (("read", True), ("set", False), ("delete_key", False)):
            real = getattr(ControlStore, name)
            monkeypatch.setattr(ControlStore, name, self._wrap(name, real, before))

    def _wrap(self, name, real, before):
        def call(store, key, *args, **kw):
            mine = threading.current_thread().name.startswith("channel-in") and name not in self.fired
            header = key.startswith("ch/") and key.rsplit("/", 1)[-1].isdigit()  # Keys.sample
            if mine and (key.endswith("/acked") if name == "set" else header):
                self.fired.append(name)
                if not before:
                    real(store, key, *args, **kw)
                raise TransportTimeout(f"{name} {key}: past its deadline (injected)")
            return real(store, key, *args, **kw)
        return call


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_store_call_past_its_deadline_does_not_end_the_hub_link(transport, monkeypatch):
    """One missed deadline in each of the link's repeatable store requests: the link makes the
    request again, every group arrives once and in order, and later groups still arrive."""
    faults = _OneTimeoutEach(monkeypatch)
    control, store, topo = _store()
    cfg = _cfg(transport, max_unacked_per_hub=100)
    sender = SampleSender(store, control, cfg, topo, 0)
    hub = SampleHub(store, control, cfg, topo, 0)
    for gid in range(4):
        sender.send(_group(gid), StartTicket(0, gid + 1))
    got = _take(hub, 4)
    assert sorted(faults.fired) == ["delete_key", "read", "set"]
    for gid in range(4, 6):
        sender.send(_group(gid), StartTicket(0, gid + 1))
    got += _take(hub, 2)
    assert [r.group.group_id for r in got] == list(range(6)) and [r.meta.seq for r in got] == list(range(6))
    assert sender.flush(20) == 0 and hub.poll() == [] and hub.duplicates_dropped == 0
    sender.close()
    hub.close()


def test_a_dead_workers_pair_is_dropped_and_its_restart_delivers():
    """A worker that dies after posting its header (its pair is never built): the hub's link for
    it gives up that pair after connect_timeout_s, the restarted worker re-posts the same seq on a
    new epoch and it is delivered; the other worker's groups flowed the whole time."""
    control, store, topo = _store(workers=2)
    cfg = _cfg("dataplane", max_unacked_per_hub=100, connect_timeout_s=1.0)
    hub = SampleHub(store, control, cfg, topo, 0)
    epoch = store.add(Keys.sample_epoch(0, 1), 1)
    store.set(Keys.sample(0, 1, 0), Header(0, epoch, "gloo", 100, 99).to_bytes())  # then it died
    live = SampleSender(store, control, cfg, topo, 0)
    for gid in range(0, 6, 2):
        live.send(_group(gid), StartTicket(0, 1))
    assert sorted(r.group.group_id for r in _take(hub, 3)) == [0, 2, 4]
    time.sleep(1.5)  # the link's build of the dead epoch has failed by now
    restarted = SampleSender(store, control, cfg, topo, 1)
    restarted.send(_group(7, worker=1), StartTicket(0, 2))
    got = _take(hub, 1, timeout_s=15)
    assert got[0].group.group_id == 7 and got[0].meta.seq == 0
    assert store.add(Keys.sample_epoch(0, 1), 0) == epoch + 1  # a new pair
    for x in (live, restarted, hub):
        x.close()


def test_a_worker_killed_before_its_build_is_given_up_when_its_restart_draws_a_new_pair():
    """A worker killed between its header and its build never takes the hub's word: the hub does
    not build that pair (a build would wait all of connect_timeout_s, 60 s by default, while the
    staleness bound holds the worker's starts); it drops it as soon as the restarted process
    draws a newer epoch, and the restart's re-post of the same seq is delivered at once."""
    control, store, topo = _store(workers=1)
    cfg = _cfg("dataplane", connect_timeout_s=60.0)
    hub = SampleHub(store, control, cfg, topo, 0)
    epoch = store.add(Keys.sample_epoch(0, 0), 1)
    store.set(Keys.sample(0, 0, 0), Header(0, epoch, "gloo", 100, 99).to_bytes())  # then it died
    time.sleep(0.5)  # the hub's link has seen the header and waits for the worker's build
    start = time.monotonic()
    restarted = SampleSender(store, control, cfg, topo, 0)
    restarted.send(_group(5), StartTicket(0, 1))
    got = _take(hub, 1, timeout_s=20)
    assert got[0].group.group_id == 5 and got[0].meta.seq == 0
    assert time.monotonic() - start < 10, time.monotonic() - start
    for x in (restarted, hub):
        x.close()


def test_a_restarted_worker_waits_out_a_hub_busy_with_its_predecessors_pair():
    """The predecessor built its pair and froze before sending: the hub's link waits
    transfer_timeout_s on it. The restarted worker's first transfer waits for the hub instead of
    timing its build out twice (2 x 2 x connect_timeout_s, less than the hub is busy) and giving up."""
    control, store, topo = _store(workers=1)
    cfg = _cfg("dataplane", connect_timeout_s=1.0, transfer_timeout_s=6.0)
    hub = SampleHub(store, control, cfg, topo, 0)
    epoch = store.add(Keys.sample_epoch(0, 0), 1)
    store.set(Keys.sample(0, 0, 0), Header(0, epoch, "gloo", 100, 99).to_bytes())
    frozen = _join_pair(store, 0, 0, epoch)  # then it sends nothing
    restarted = SampleSender(store, control, cfg, topo, 0)
    restarted.send(_group(4), StartTicket(0, 1))
    got = _take(hub, 1, timeout_s=20)
    assert got[0].group.group_id == 4 and restarted._links[0].error == ""
    assert store.add(Keys.sample_epoch(0, 0), 0) == epoch + 1  # one new pair: no try was wasted
    for x in (restarted, hub):
        x.close()
    del frozen


def test_staleness_gate_holds_globally_under_concurrency():
    control, store, topo = _store()
    bound = StalenessBound(max_staleness=1, groups_per_step=5)
    tickets: list[StartTicket] = []
    lock = threading.Lock()

    def grab():
        gate = StalenessGate(store, bound)
        while (t := gate.try_start()) is not None:
            with lock:
                tickets.append(t)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(tickets) == bound.capacity(0) == 10
    assert sorted(t.index for t in tickets) == list(range(1, 11))
    publish_version(store, 2)
    more = StalenessGate(store, bound)
    assert [more.try_start().index for _ in range(10)] == list(range(11, 21)) and more.try_start() is None


def test_a_dead_workers_reservations_are_given_back():
    control, store, topo = _store()
    gate = StalenessGate(store, StalenessBound(max_staleness=0, groups_per_step=3), worker_id=1)
    tickets = [gate.try_start() for _ in range(3)]
    assert gate.try_start() is None
    gate.posted(tickets[0])  # one reached its hub; two die with the worker
    assert release_reservations(store, 1) == 2 and gate.started() == 1
    assert release_reservations(store, 1) == 0
    assert [gate.try_start().index for _ in range(2)] == [2, 3] and gate.try_start() is None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_group_stops_being_outstanding_once_durable_at_the_hub(transport):
    control, store, topo = _store()
    cfg = _cfg(transport, max_unacked_per_hub=10)
    gate = StalenessGate(store, StalenessBound(max_staleness=0, groups_per_step=4), worker_id=0)
    sender = SampleSender(store, control, cfg, topo, 0, gate=gate)
    tickets = [gate.try_start() for _ in range(3)]
    for gid, t in zip((0, 2), tickets):
        sender.send(_group(gid), t)
    if transport == "dataplane":  # no hub yet: in flight, still outstanding
        time.sleep(0.3)
        assert store.add("stale/outstanding/0", 0) == 3
    hub = SampleHub(store, control, cfg, topo, 0)
    _take(hub, 2)
    assert sender.flush(20) == 0
    assert release_reservations(store, 0) == 1  # only the never-sent third one
    sender.close()
    hub.close()


def test_config_edges():
    with pytest.raises(ValueError, match="workers"):
        Topology(workers=0)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBound(max_staleness=-1, groups_per_step=1)
    with pytest.raises(ValueError, match="transport"):
        ChannelConfig(transport="carrier pigeon")
    with pytest.raises(ValueError, match="backend"):
        ChannelConfig(backend="mpi")
    with pytest.raises(ValueError, match="timeout_s"):
        HeartbeatConfig(interval_s=1.0, timeout_s=1.5)
