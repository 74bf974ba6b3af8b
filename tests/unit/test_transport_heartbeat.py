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
    trainer = Heartbeat(control, cfg, MemberInfo.here(TRAINER, 0), watch=[(WORKER, 3)], on_loss=losses.append).start()
    peer = Heartbeat(control, cfg, worker).start()
    try:
        wait_for(lambda: trainer.is_alive(WORKER, 3), 5, "first beat")
        trainer.step = 12
        peer.close()
        t0 = time.monotonic()
        wait_for(lambda: losses, 5, "loss report", poll=0.01)
        elapsed = time.monotonic() - t0
        time.sleep(0.3)
    finally:
        trainer.close()
    assert len(losses) == 1 and losses[0].peer == "rollout 3 (node7, pid 4242)" and losses[0].step == 12
    assert cfg.timeout_s - 0.2 <= elapsed <= cfg.timeout_s + 0.5
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
