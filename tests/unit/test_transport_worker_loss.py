"""A lost rollout worker is that worker's loss, not the run's, in one process.

Heartbeat: a process that beats in the place of another of the same id (restarted) is reported
as the loss of the old one, once, and counted. Weight sync: a member that dies in its round is
named and the publish ends without failing; a worker that reaches its safe point after a
publish's rounds (late, or restarted) is offered the last version again by the background
publisher. Threads over a real TCPStore and gloo, as in ``test_transport_weight_sync.py``.
"""

from __future__ import annotations

import json
import threading
import time

import torch

from megatron_darl.transport import (
    TRAINER, WORKER, ControlPlaneConfig, Heartbeat, HeartbeatConfig, MemberInfo, PeerLoss, WeightReceiver,
    WeightSender, WeightSyncConfig, connect_store, published_version, register, serve_store,
)
from megatron_darl.transport.weight_protocol import SyncKeys
from megatron_darl.transport.weight_publisher import BackgroundPublisher
from tests.distributed.procs.launcher import free_port, wait_for
from tests.unit.test_transport_weight_rounds import _close, _loader, _serve
from tests.unit.test_transport_weight_sync import _weights, _world

CFG = WeightSyncConfig(backend="gloo", bucket_bytes=300, join_timeout_s=10, collective_timeout_s=20,
                       ack_timeout_s=20, gather_s=0.05)


def test_a_restarted_peer_is_reported_as_the_loss_of_its_predecessor_once():
    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10)
    store = serve_store(control)
    cfg = HeartbeatConfig(interval_s=0.05, timeout_s=2.0)
    losses: list[PeerLoss] = []
    old, new = (MemberInfo(role=WORKER, rank=3, host="node7", pid=pid) for pid in (4242, 5151))
    register(store, old)
    trainer = Heartbeat(control, cfg, MemberInfo.here(TRAINER, 0), watch=[(WORKER, 3)], on_loss=losses.append).start()
    peer = Heartbeat(control, cfg, old).start()
    try:
        wait_for(lambda: trainer.is_alive(WORKER, 3), 5, "first beat")
        peer.close()
        peer = Heartbeat(control, cfg, new).start()  # within the timeout: never silent long enough
        wait_for(lambda: losses, 5, "loss report", poll=0.01)
        time.sleep(0.3)
    finally:
        peer.close()
        trainer.close()
    assert len(losses) == 1 and losses[0].peer == "rollout 3 (node7, pid 4242)"
    assert losses[0].replaced_by == "rollout 3 (node7, pid 5151)"
    assert trainer.losses(WORKER) == 1 and trainer.incarnations(WORKER, 3) == 2
    assert trainer.is_alive(WORKER, 3) and trainer.member(WORKER, 3) == new


def test_a_loss_whose_starts_cannot_be_given_back_is_said_and_the_heartbeat_goes_on(monkeypatch, caplog):
    """Rank 0's loss handler gives a lost worker's starts back through the ledger; when that call
    fails (the store past its deadline) the handler says so in one line and returns: raised in
    the heartbeat thread, it was swallowed there as a store error, and nothing said the bound
    stayed tighter."""
    import logging

    from megatron_darl.loop import endpoints
    from megatron_darl.transport.config import TransportConfig
    from megatron_darl.transport.store import TransportTimeout

    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10)
    store = serve_store(control)  # noqa: F841 (serves the handler's connection)
    on_loss = endpoints._release_on_loss(TransportConfig(control=control), leave=lambda loss: None)
    loss = PeerLoss("rollout 1 (node2, pid 77)", WORKER, 1, 31.5, 12)
    with caplog.at_level(logging.ERROR):
        on_loss(loss)  # the real ledger: nothing reserved, nothing given back
    assert "0 groups in flight dropped" in caplog.text

    def stalled(store, worker_id):
        raise TransportTimeout("control ledger: no answer within 30 s")

    monkeypatch.setattr(endpoints, "release_reservations", stalled)
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        on_loss(loss)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "could not be given back (control ledger: no answer within 30 s)" in lines[0]
    assert "rollout 1 (node2, pid 77)" in lines[0] and "until a process of rollout 1 joins" in lines[0]


def test_a_member_that_dies_in_its_round_is_named_and_the_publish_does_not_fail():
    """Workers 0 and 1 share a round; worker 0 dies in it (stops beating, never answers), which
    fails the round for worker 1 too, and a newer version is staged: the publish ends naming
    worker 0 as lost, without WeightSyncFailed (it used to fail 'for every rollout worker'), and
    the next publish reaches worker 1."""
    control, store, hb, whbs, topo = _world(2)
    cfg = WeightSyncConfig(backend="gloo", join_timeout_s=10, collective_timeout_s=3, ack_timeout_s=5, gather_s=1.0)
    sender = WeightSender(store, control, cfg, topo, 0, hb)
    receivers = [WeightReceiver(connect_store(control), control, cfg, topo, w, lambda named: None) for w in range(2)]
    stop = threading.Event()

    def die(*args, **kwargs):  # in the round, its group built: no more beats, no answer
        whbs[0].close()
        stop.wait(30)

    receivers[0]._receive_buckets = die
    threads = [threading.Thread(target=_serve, args=(r, 2, stop), daemon=True) for r in receivers]
    for t in threads:
        t.start()
    start = time.monotonic()
    try:
        first = sender.publish(1, _weights(1), newer=lambda: True)
        seconds = time.monotonic() - start
        second = sender.publish(2, _weights(2))
    finally:
        _close(stop, threads, [hb, *whbs])
    assert json.loads(store.get(SyncKeys.plan(1, 0, 0)))["members"] == [0, 1]  # one round, both in it
    assert first.members == [] and not first.published and first.attempts == 1
    assert len(first.missing) == 1 and first.missing[0].startswith("rollout 0 (") and "lost" in first.missing[0]
    assert seconds < 15  # a killed process's sockets close at once; this one's time out
    assert second.members == [1] and second.acked == [1] and published_version(store) == 2
    assert receivers[1].version == 2


def test_a_worker_too_late_for_a_publish_is_offered_the_version_again():
    """Worker 1 reaches its safe point after the publish of v1 left it out: the background
    publisher offers v1 again (a new offer), worker 1 takes it, and worker 0, which holds v1,
    is not asked again."""
    control, store, hb, whbs, topo = _world(2)
    cfg = WeightSyncConfig(backend="gloo", bucket_bytes=300, join_timeout_s=2.0, collective_timeout_s=20,
                           ack_timeout_s=20, gather_s=0.05)
    sender = WeightSender(connect_store(control), control, cfg, topo, 0, hb)
    publisher = BackgroundPublisher(sender, linger_s=0.05)
    loaded: list[dict] = [{}, {}]
    receivers = [WeightReceiver(connect_store(control), control, cfg, topo, w, _loader(loaded[w])) for w in range(2)]
    logs: list[list] = [[], []]
    stop = threading.Event()
    # worker 1 comes 3 s after worker 0 took v1: past the first offer's join window (2 s from it)
    threads = [threading.Thread(target=_serve, args=(receivers[0], 1, stop, 0.0, logs[0]), daemon=True),
               threading.Thread(target=_serve, args=(receivers[1], 1, stop, 3.0, logs[1], logs[0]), daemon=True)]
    for t in threads:
        t.start()
    try:
        publisher.submit(1, _weights(1))
        wait_for(lambda: receivers[1].version == 1, 15, "worker 1 to take v1", poll=0.05)
        report = publisher.wait()
    finally:
        publisher.close()
        _close(stop, threads, [hb, *whbs])
    assert sender.offers == 2 and report is not None and report.members == [1] and report.acked == [1]
    assert [v for _, v in logs[0]] == [1] and [v for _, v in logs[1]] == [1]  # each loaded v1 once
    for name, tensor in _weights(1):
        assert torch.equal(loaded[1][name], tensor), name
