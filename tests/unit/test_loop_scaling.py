"""The pieces that let a second GPU add throughput: whole-batch admission under the staleness bound,
a worker's fair share of it, the trainer's backlog of surplus groups, per-worker rollout metrics
through the heartbeat, and the GPU-count cluster presets."""

from __future__ import annotations

import threading
import time

import pytest

from launch.config import load_run_config
from megatron_darl.loop.endpoints import Backlog
from megatron_darl.loop.metrics import WorkerRates
from megatron_darl.rollout.worker import fair_share
from megatron_darl.transport import (
    TRAINER, WORKER, ControlPlaneConfig, Heartbeat, HeartbeatConfig, MemberInfo, StalenessBound, StalenessGate,
    serve_store,
)
from tests.distributed.procs.launcher import free_port


def _store():
    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10, poll_interval_s=0.001)
    return control, serve_store(control)


def test_a_batch_is_reserved_whole_or_not_at_all():
    """A batch engine's batch never shrinks to what the bound has left (a recompilation each)."""
    control, store = _store()
    gate = StalenessGate(store, StalenessBound(max_staleness=1, groups_per_step=8), worker_id=0)
    first = gate.try_start_batch(8)
    assert [t.index for t in first] == list(range(1, 9))
    assert gate.try_start_batch(12) == [] and gate.started() == 8  # 12 > the 8 left: nothing taken
    assert len(gate.try_start_batch(8)) == 8 and gate.try_start_batch(1) == []
    assert store.add("stale/outstanding/0", 0) == 16  # a dead worker's would be given back


def test_concurrent_batches_never_overshoot_the_bound():
    control, store = _store()
    bound = StalenessBound(max_staleness=1, groups_per_step=6)  # 12 groups may start at version 0
    got: list[int] = []
    lock = threading.Lock()

    def grab():
        gate = StalenessGate(store, bound)
        for _ in range(20):
            batch = gate.try_start_batch(4)
            with lock:
                got.extend(t.index for t in batch)

    threads = [threading.Thread(target=grab) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(got) == list(range(1, 13)) and StalenessGate(store, bound).started() == 12


@pytest.mark.parametrize("limit, b, eta, workers, expected", [
    (8, 8, 2, 1, 8),  # one worker: its batch
    (8, 8, 2, 2, 8),  # the bound lets 24 start: both fill their batch
    (8, 8, 0, 2, 4),  # synchronous: B/2 each, not B for one and nothing for the other
    (64, 8, 1, 3, 6),  # ceil(16 / 3)
    (8, 1, 0, 4, 1),  # never below one
])
def test_a_workers_batch_is_at_most_its_share_of_the_bound(limit, b, eta, workers, expected):
    assert fair_share(limit, StalenessBound(max_staleness=eta, groups_per_step=b), workers) == expected


def test_the_backlog_makes_one_step_per_b_groups_received():
    backlog = Backlog(per_step=8)
    assert backlog.need() == 8
    backlog.took(16)  # two workers' batches arrived at once
    assert backlog.need() == 0  # the next step starts without waiting: 8 untrained groups are there
    backlog.took(0)
    assert backlog.need() == 8
    backlog.took(11)
    assert backlog.surplus == 3 and backlog.need() == 5


def test_worker_rates_are_per_step_deltas_of_each_workers_stats():
    rates = WorkerRates(2)
    stats = {0: {"engine_seconds": 2.0, "engine_calls": 1, "groups_finished": 8, "sync_seconds": 0.1,
                 "idle_gate_seconds": 0.5, "flush_seconds": 0.4},
             1: {"engine_seconds": 1.0, "engine_calls": 1, "groups_finished": 4, "collect_seconds": 0.2}}
    first = rates.step(lambda w: stats[w])
    assert first["generation_seconds_w0"] == 2.0 and first["generation_seconds"] == 1.5
    assert first["engine_batch_groups"] == 6.0 and first["worker_idle_gate_seconds"] == 0.25
    assert first["worker_flush_seconds"] == 0.2 and first["worker_collect_seconds"] == 0.1
    assert first["worker_admit_seconds"] == 0.0
    stats[0] = {**stats[0], "engine_seconds": 5.0, "engine_calls": 2, "groups_finished": 16}
    second = rates.step(lambda w: stats[w])
    assert second["generation_seconds_w0"] == 3.0 and second["generation_seconds_w1"] == 0.0
    assert second["engine_batch_groups"] == 8.0 and second["worker_sync_seconds"] == 0.0


def test_a_workers_stats_reach_the_trainer_with_its_heartbeat():
    control, store = _store()
    cfg = HeartbeatConfig(interval_s=0.05, timeout_s=2.0)
    calls = {"n": 0}

    def stats():
        calls["n"] += 1
        return {"engine_seconds": 0.5 * calls["n"]}

    trainer = Heartbeat(control, cfg, MemberInfo.here(TRAINER, 0), watch=[(WORKER, 1)]).start()
    worker = Heartbeat(control, cfg, MemberInfo.here(WORKER, 1), stats=stats).start()
    try:
        deadline = time.monotonic() + 5
        while trainer.peer_stats(WORKER, 1).get("engine_seconds", 0) < 1.0:
            assert time.monotonic() < deadline, trainer.peer_stats(WORKER, 1)
            time.sleep(0.02)
    finally:
        worker.close()
        trainer.close()
    assert trainer.peer_stats(WORKER, 0) == {}  # never beat


@pytest.mark.parametrize("split, trainer, rollout", [("2:2", [0, 1], [2, 3]), ("3:1", [0, 1, 2], [3]),
                                                     ("1:3", [0], [1, 2, 3])])
def test_gpu_counts_set_ranks_workers_and_devices(split, trainer, rollout):
    t, r = split.split(":")
    groups = 12 if t == "3" else 8  # B must split over the DP ranks
    cfg = load_run_config(["cluster=gpu4", f"cluster.trainer_gpus={t}", f"cluster.rollout_gpus={r}",
                           f"algorithm.groups_per_step={groups}"])
    c = cfg.cluster
    assert (c.trainer_devices, c.rollout_devices) == (trainer, rollout)
    assert c.trainer_ranks == len(trainer) and c.rollout_workers == len(rollout)
    assert cfg.topology.workers == len(rollout) and cfg.topology.hubs == len(trainer)


def test_gpu4_preset_is_two_and_two_and_counts_are_checked():
    c = load_run_config(["cluster=gpu4"]).cluster
    assert (c.trainer_gpus, c.rollout_gpus, c.trainer_devices, c.rollout_devices) == (2, 2, [0, 1], [2, 3])
    with pytest.raises(ValueError, match="cluster.trainer_gpus=-1"):
        load_run_config(["cluster.trainer_gpus=-1"])
