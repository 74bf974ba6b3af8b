"""Heartbeats in one process: a peer that stops beating is named within the timeout, once."""

from __future__ import annotations

import time

import torch.distributed as dist

from megatron_darl.transport import (
    TRAINER, WORKER, ControlPlaneConfig, Heartbeat, HeartbeatConfig, MemberInfo, PeerLoss, build_group,
    register, serve_store,
)
from tests.distributed.procs.launcher import free_port, wait_for


def test_silent_peer_is_reported_once_by_name_within_the_timeout():
    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10)
    store = serve_store(control)
    cfg = HeartbeatConfig(interval_s=0.05, timeout_s=0.5)
    losses: list[PeerLoss] = []
    worker = MemberInfo(role=WORKER, rank=3, host="node7", pid=4242)
    register(store, worker)
    noticed: list[float] = []  # when the monitor reported, on its own thread (not when this one woke)
    trainer = Heartbeat(control, cfg, MemberInfo.here(TRAINER, 0), watch=[(WORKER, 3)],
                        on_loss=lambda loss: (noticed.append(time.monotonic()), losses.append(loss))).start()
    peer = Heartbeat(control, cfg, worker).start()
    try:
        wait_for(lambda: trainer.is_alive(WORKER, 3), 5, "first beat")
        trainer.step = 12
        peer.close()
        t0 = time.monotonic()
        wait_for(lambda: losses, 5, "loss report", poll=0.01)
        elapsed = noticed[0] - t0
        time.sleep(0.3)
    finally:
        trainer.close()
    assert len(losses) == 1 and losses[0].peer == "rollout 3 (node7, pid 4242)" and losses[0].step == 12
    assert losses[0].silent_s >= cfg.timeout_s and cfg.timeout_s - 0.2 <= elapsed <= cfg.timeout_s + 1.5
    assert not trainer.is_alive(WORKER, 3) and trainer.is_lost(WORKER, 3)


def test_data_plane_group_is_independent_of_the_default_group():
    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10)
    store = serve_store(control)
    group = build_group(store, "solo", 0, 1, "gloo", 5.0)
    assert not dist.is_initialized()  # no default group was needed or created
    import torch

    t = torch.arange(4.0)
    group.broadcast(t, 0, "solo tensor")
    assert torch.equal(t, torch.arange(4.0)) and group.size == 1


def test_counters_posted_before_a_send_are_read_at_once_and_a_restart_keeps_the_old_counts():
    """The trainer's metrics count a worker's reward errors as soon as it trains the groups they
    came with (the worker posts, the trainer refreshes), not a beat later; a restarted worker's new
    process starts counting from zero without taking its predecessor's counts out of the sums."""
    from megatron_darl import counters
    from megatron_darl.transport import connect_store

    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10)
    store = serve_store(control)
    slow = HeartbeatConfig(interval_s=30.0, timeout_s=90.0)  # no beat of the threads during the test
    trainer = Heartbeat(control, slow, MemberInfo.here(TRAINER, 0), watch=[(WORKER, 0)]).start()
    first = Heartbeat(control, slow, MemberInfo(WORKER, 0, "node1", 101)).start()
    worker_store = connect_store(control, who="rollout 0")
    try:
        trainer.refresh(store)
        base = trainer.peer_counters()[counters.REWARD_ERRORS]
        counters.count(counters.REWARD_ERRORS, 3)
        trainer.refresh(store)
        assert trainer.peer_counters()[counters.REWARD_ERRORS] == base  # not posted yet
        first.post_counters(worker_store)
        trainer.refresh(store)
        assert trainer.peer_counters()[counters.REWARD_ERRORS] == base + 3
        second = Heartbeat(control, slow, MemberInfo(WORKER, 0, "node1", 202)).start()  # the restart
        trainer.refresh(store)
        assert trainer.incarnations(WORKER, 0) == 2
        # this process's counts are posted again by the new member: old + new in the sum
        assert trainer.peer_counters()[counters.REWARD_ERRORS] == 2 * (base + 3)
        second.close()
    finally:
        first.close(), trainer.close(), store.close()
