"""Weight sync that never makes one worker wait for another, nor the trainer for the workers.

Rounds: a worker at its safe point is served at once, while another is still generating, and the
published version moves with the first ack. Upgrade: a round sends the newest staged version and
the workers hold and ack that one. ``BackgroundPublisher``: the trainer's ``submit`` returns while
no worker is ready, a newer version replaces one nobody took, and a failed sync is raised by the
next call. Threads over a real TCPStore and gloo, as in ``test_transport_weight_sync.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_darl.transport import (
    WeightReceiver, WeightSender, WeightSyncConfig, WeightSyncFailed, connect_store,
    published_version,
)
from megatron_darl.transport.store import TransportTimeout
from megatron_darl.transport.weight_publisher import BackgroundPublisher
from tests.distributed.procs.launcher import wait_for
from tests.unit.test_transport_weight_sync import _serve_until_error, _weights, _world

CFG = WeightSyncConfig(backend="gloo", bucket_bytes=300, join_timeout_s=10, collective_timeout_s=20,
                       ack_timeout_s=20, gather_s=0.05)


def _serve(receiver: WeightReceiver, until: int, stop: threading.Event, start_after: float = 0.0,
           log: list | None = None, after: list | None = None) -> None:
    """Take offered syncs (once ``after`` holds an entry, when given, and ``start_after`` seconds
    later) until holding ``until``; log (time, version)."""
    while after is not None and not after and not stop.is_set():
        time.sleep(0.005)
    time.sleep(start_after)
    while receiver.version < until and not stop.is_set():
        if receiver.maybe_sync() is not None and log is not None:
            log.append((time.monotonic(), receiver.version))
        time.sleep(0.005)


def _loader(into: dict):
    def load(named):
        into.update({n: t.clone() for n, t in named})
    return load


def _close(stop, threads, beats):
    stop.set()
    for t in threads:
        t.join(10)
    for h in beats:
        h.close()


def test_a_worker_at_its_safe_point_is_served_while_another_still_generates():
    control, store, hb, whbs, topo = _world(2)
    sender = WeightSender(store, control, CFG, topo, 0, hb)
    receivers = [WeightReceiver(connect_store(control), control, CFG, topo, w, lambda named: None) for w in range(2)]
    logs: list[list] = [[], []]
    stop = threading.Event()
    # worker 1 comes to its safe point 1 s after worker 0 was served: a sender that waited for
    # both would serve worker 0 only at the join timeout (10 s)
    threads = [threading.Thread(target=_serve, args=(receivers[0], 1, stop, 0.0, logs[0]), daemon=True),
               threading.Thread(target=_serve, args=(receivers[1], 1, stop, 1.0, logs[1], logs[0]), daemon=True)]
    published: list[tuple[float, int]] = []

    def watch():
        while not stop.is_set():
            published.append((time.monotonic(), published_version(store)))
            time.sleep(0.01)

    threads.append(threading.Thread(target=watch, daemon=True))
    start = time.monotonic()
    for t in threads:
        t.start()
    try:
        report = sender.publish(1, _weights(1))
    finally:
        _close(stop, threads, [hb, *whbs])
    assert report.members == [0, 1] and report.acked == [0, 1] and report.published
    assert report.attempts == 2 and report.rounds_sent == 2  # one round each: worker 0 did not wait
    assert logs[0][0][0] - start < 5.0, "worker 0 waited for worker 1's safe point"
    assert logs[1][0][0] - logs[0][0][0] >= 1.0
    moved = next(t for t, v in published if v == 1)
    assert moved < logs[1][0][0], "the published version waited for the last worker"
    # the second round's gather waited out worker 1's second (less the sender's own lag after round 0)
    assert report.wait_seconds >= 0.5 and report.wait_seconds + report.transfer_seconds <= report.seconds


def test_a_round_sends_the_newest_staged_version_and_the_workers_ack_it():
    control, store, hb, whbs, topo = _world(2)
    sender = WeightSender(store, control, CFG, topo, 0, hb)
    staged = {v: sender.stage_weights(v, _weights(v)) for v in (1, 2)}
    loaded = [{}, {}]
    receivers = [WeightReceiver(connect_store(control), control, CFG, topo, w, _loader(loaded[w])) for w in range(2)]
    stop = threading.Event()
    threads = [threading.Thread(target=_serve, args=(r, 1, stop), daemon=True) for r in receivers]
    for t in threads:
        t.start()
    try:
        report = sender.publish(1, staged[1], upgrade=lambda: staged[2])  # offered as 1, 2 staged since
    finally:
        _close(stop, threads, [hb, *whbs])
    assert report.version == 2 and report.acked == [0, 1] and published_version(store) == 2
    assert [r.version for r in receivers] == [2, 2]
    for w in range(2):
        for name, tensor in _weights(2):
            assert torch.equal(loaded[w][name], tensor), name


def test_background_publish_returns_at_once_and_the_newest_version_wins():
    control, store, hb, whbs, topo = _world(1)
    sender = WeightSender(connect_store(control), control, CFG, topo, 0, hb)
    publisher = BackgroundPublisher(sender)
    loaded: dict = {}
    receiver = WeightReceiver(connect_store(control), control, CFG, topo, 0, _loader(loaded))
    stop = threading.Event()
    log: list = []
    thread = threading.Thread(target=_serve, args=(receiver, 3, stop, 0.8, log), daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        assert publisher.submit(1, _weights(1)) is None  # no sync finished yet
        publisher.submit(2, _weights(2))
        publisher.submit(3, _weights(3))
        assert time.monotonic() - start < 0.5, "submit waited for the worker"
        report = publisher.wait()
    finally:
        publisher.close()
        _close(stop, [thread], [hb, *whbs])
    # v1 was offered before the worker came; by then 3 was the newest: it is what the worker took
    assert report is not None and report.version == 3 and receiver.version == 3
    assert [v for _, v in log] == [3] and published_version(store) == 3
    for name, tensor in _weights(3):
        assert torch.equal(loaded[name], tensor), name


def test_a_background_sync_that_failed_is_raised_by_the_next_call():
    control, store, hb, whbs, topo = _world(1)
    sender = WeightSender(connect_store(control), control, CFG, topo, 0, hb)
    publisher = BackgroundPublisher(sender)

    def broken(named):
        raise RuntimeError("CUDA out of memory")

    receiver = WeightReceiver(connect_store(control), control, CFG, topo, 0, broken)
    errors: list = []
    stop = threading.Event()
    thread = threading.Thread(target=_serve_until_error, args=(receiver, errors, stop), daemon=True)
    thread.start()
    try:
        publisher.submit(1, _weights(1))
        with pytest.raises(WeightSyncFailed, match="CUDA out of memory"):
            publisher.wait()
        with pytest.raises(WeightSyncFailed):  # sticky: nothing is published after a failure
            publisher.submit(2, _weights(2))
    finally:
        publisher.close()
        _close(stop, [thread], [hb, *whbs])
    assert len(errors) == 1 and published_version(store) == 0


def test_a_look_for_late_workers_that_raises_is_raised_by_the_next_call():
    """Between publishes the thread reads the store for late workers (``waiting_for``); a store
    call past its deadline there ends the thread, and the trainer hears of it at once (it used to
    die unseen: ``submit`` then staged versions nobody sent, and ``wait`` slept its whole bound)."""
    control, store, hb, whbs, topo = _world(1)
    sender = WeightSender(connect_store(control), control, CFG, topo, 0, hb)

    def frozen(version):
        raise TransportTimeout("control store: no answer within 30 s (trainer 0 frozen?)")

    sender.waiting_for = frozen  # what the idle thread asks after v1 went out
    publisher = BackgroundPublisher(sender, linger_s=0.01)
    stop = threading.Event()
    thread = threading.Thread(target=_serve, args=(
        WeightReceiver(connect_store(control), control, CFG, topo, 0, lambda named: None), 1, stop), daemon=True)
    thread.start()
    try:
        assert publisher.submit(1, _weights(1)) is None
        deadline = time.monotonic() + 20
        while publisher.failure() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert published_version(store) == 1 and isinstance(publisher.failure(), TransportTimeout)
        with pytest.raises(TransportTimeout, match="no answer within 30 s"):
            publisher.submit(2, _weights(2))
        with pytest.raises(TransportTimeout, match="no answer within 30 s"):
            publisher.wait()  # at once, not after its bound
        start = time.monotonic()
        publisher.close()
        assert time.monotonic() - start < 5.0
    finally:
        publisher.close()
        _close(stop, [thread], [hb, *whbs])


def test_a_one_shot_export_waits_for_every_worker_in_its_one_round():
    """The blocking publish streams the trainer's export once (a TP collective its peers iterate
    once): a worker that comes after the first one's gather window must still get the tensors.
    A second round had nothing left to send, and that worker acked the version holding its old
    weights (a CI run of the TP2xPP2 sync caught one)."""
    control, store, hb, whbs, topo = _world(2)
    sender = WeightSender(store, control, CFG, topo, 0, hb)
    loaded: list[dict] = [{}, {}]
    receivers = [WeightReceiver(connect_store(control), control, CFG, topo, w, _loader(loaded[w])) for w in range(2)]
    logs: list[list] = [[], []]
    stop = threading.Event()
    threads = [threading.Thread(target=_serve, args=(receivers[0], 1, stop, 0.0, logs[0]), daemon=True),
               threading.Thread(target=_serve, args=(receivers[1], 1, stop, 1.0, logs[1]), daemon=True)]
    for t in threads:
        t.start()
    try:
        report = sender.publish(1, iter(_weights(1)))  # one-shot, as ``export_hf_stage`` is
        wait_for(lambda: all(logs), 10, "both workers to hold v1")
    finally:
        _close(stop, threads, [hb, *whbs])
    assert report.members == [0, 1] and report.rounds_sent == 1 and report.attempts == 1
    for w in range(2):
        assert set(loaded[w]) == {name for name, _ in _weights(1)}, w
        for name, tensor in _weights(1):
            assert torch.equal(loaded[w][name], tensor), (w, name)
