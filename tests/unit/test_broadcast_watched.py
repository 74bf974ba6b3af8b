"""``DataPlaneGroup.broadcast_watched``: a receiving member of a gloo broadcast walks away as soon
as the sender says it gave up, instead of waiting out the group's timeout (a weight sync whose
leader lost another member held the remaining ones 300 s); and the root's watched wait
(``broadcast_async(given_up=...)``) ends as soon as a member says it left, not when that member's
socket happens to close (a weight-sync leader can otherwise sit in a bucket its members left);
and a group left in such a broadcast is let go at once (``retire``), not in a destructor that
waits out the group timeout. Real gloo groups over the run's store, one thread per member."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from megatron_darl.transport.config import ControlPlaneConfig
from megatron_darl.transport.process_group import build_group
from megatron_darl.transport.store import TransportTimeout, connect_store, serve_store
from tests.distributed.procs.launcher import free_port


def _groups(name: str, size: int, timeout_s: float):
    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10, poll_interval_s=0.001)
    server = serve_store(control)  # noqa: F841 - serves the members' connections
    out = [None] * size

    def member(rank):  # each member its own store connection, as each process has
        store = connect_store(control, who=f"member {rank}")
        out[rank] = build_group(store, name, rank, size, "gloo", 10.0, collective_timeout_s=timeout_s)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(g is not None for g in out)
    return out


def test_a_member_gives_up_when_the_sender_says_so_not_at_the_timeout():
    root, _idle, member = _groups("ws/test/given_up", 3, timeout_s=30.0)
    gave_up = threading.Event()
    buf = torch.empty(16, dtype=torch.uint8)
    start = time.monotonic()  # before the timer: its 1.5 s cannot begin earlier
    threading.Timer(1.5, gave_up.set).start()  # the leader's "aborted" header, 1.5 s in
    with pytest.raises(TransportTimeout, match="given up: the leader aborted"):
        member.broadcast_watched(buf, 0, "bucket 0",
                                 given_up=lambda: "the leader aborted" if gave_up.is_set() else None)
    assert 1.5 <= time.monotonic() - start < 5.0, time.monotonic() - start
    del root


def test_a_broadcast_that_completes_never_asks_and_delivers():
    root, a, b = _groups("ws/test/delivers", 3, timeout_s=30.0)
    data = torch.arange(64, dtype=torch.uint8)
    asked = []
    got = [torch.empty(64, dtype=torch.uint8) for _ in range(2)]
    threads = [threading.Thread(target=g.broadcast_watched, args=(t, 0, "bucket 0", lambda: asked.append(1)))
               for g, t in ((a, got[0]), (b, got[1]))]
    for t in threads:
        t.start()
    root.broadcast(data.clone(), 0, "bucket 0")
    for t in threads:
        t.join(10)
    assert all(torch.equal(g, data) for g in got) and asked == []


def test_the_root_stops_sending_once_a_member_says_it_left():
    root, _a, _b = _groups("ws/test/root_watch", 3, timeout_s=30.0)
    left = threading.Event()
    data = torch.zeros(64 << 20, dtype=torch.uint8)  # more than the sockets buffer: unread, it never completes
    start = time.monotonic()  # before the timer
    threading.Timer(1.5, left.set).start()  # a member posts its failure 1.5 s in
    wait = root.broadcast_async(data, 0, "bucket 0", given_up=lambda: "rollout 1 left it" if left.is_set() else None)
    with pytest.raises(TransportTimeout, match="given up: rollout 1 left it"):
        wait()
    assert 1.5 <= time.monotonic() - start < 5.0, time.monotonic() - start


def test_a_group_left_in_an_abandoned_broadcast_is_let_go_at_once():
    # the members keep their ends open and never read: the root's collective stays pending until
    # the 30 s group timeout, and a gloo group's destructor waits for it
    root, _a, _b = _groups("ws/test/retire", 3, timeout_s=30.0)
    data = torch.zeros(64 << 20, dtype=torch.uint8)
    wait = root.broadcast_async(data, 0, "bucket 0", given_up=lambda: "rollout 1 left it")
    given_up = False
    try:
        wait()
    except TransportTimeout:
        given_up = True
    assert given_up
    start = time.monotonic()
    root.retire()
    del root, wait  # the last references in this thread
    gc.collect()
    assert time.monotonic() - start < 2.0, time.monotonic() - start
