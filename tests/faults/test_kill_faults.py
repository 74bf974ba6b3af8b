"""Dead peers are loud and bounded: a killed worker is named within the heartbeat timeout and
training goes on without it; a killed trainer makes the surviving worker exit non-zero within
the timeout; no process of either job step is left behind.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

from megatron_darl.exit_codes import ExitCode
from tests.distributed.procs.launcher import wait_for
from tests.distributed.procs.scenario import Scenario

HB_TIMEOUT = 4.0  # the procs' --hb-timeout default
SLACK = 2.0  # heartbeat interval + polling + a loaded 2-core machine


def _sessions_alive(pids: list[int]) -> list[int]:
    alive = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.info["pid"]) in pids and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.info["pid"])
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return alive


@pytest.mark.fault(kind="process", name="kill -9 of a rollout worker, then of the trainer")
def test_killed_worker_is_reported_and_killed_trainer_stops_workers(tmp_path, fault_record):
    """A killed worker is named within the heartbeat timeout and training goes on; a killed trainer makes the other worker exit 3; nothing is left running."""
    # eta = 0: the dead worker's in-flight reservations must be given back or the next step starves
    sc = Scenario(out=tmp_path, trainers=1, workers=2, stages=1, steps=200, gps=4, eta=0,
                  trainer_args=["--hub-delay-s", "0.05"])
    procs = sc.launch()
    pids = [p.pid for p in procs.procs.values()]
    try:
        wait_for(lambda: len(sc.records("hub0.jsonl")) >= 8, 120, "8 groups at the hub")
        t_kill = time.time()
        procs.kill("worker1")
        wait_for(lambda: any(r["rank"] == 1 for r in sc.records("losses.jsonl")), HB_TIMEOUT + 10, "loss report")
        loss = next(r for r in sc.records("losses.jsonl") if r["rank"] == 1)
        assert loss["time"] - t_kill <= HB_TIMEOUT + SLACK, (loss, t_kill)
        assert loss["peer"].startswith("rollout 1 (") and f"pid {procs.procs['worker1'].pid}" in loss["peer"]
        # training goes on: later versions are published to the surviving worker alone
        wait_for(lambda: any(r["time"] > loss["time"] and r["published"] and r["members"] == [0]
                             for r in sc.records("sync0.jsonl")), 60, "a sync after the loss", poll=0.2)
        n_before = len(sc.records("hub0.jsonl"))
        wait_for(lambda: len(sc.records("hub0.jsonl")) >= n_before + 4, 30, "groups after the loss")
        t_trainer = time.time()
        procs.kill("trainer0")
        code = procs.wait("worker0", HB_TIMEOUT + 15)
        assert code == ExitCode.TRAINER_LOST, procs.logs()
        assert time.time() - t_trainer <= HB_TIMEOUT + SLACK + 3
        trainer_s = time.time() - t_trainer
    finally:
        procs.close()
    assert _sessions_alive(pids) == []
    fault_record["observed"] = (f"worker 1 named by the trainer {loss['time'] - t_kill:.1f} s after kill -9 "
                                f"(its reservations released), syncs went on to worker 0; after kill -9 of "
                                f"the trainer worker 0 exited {int(ExitCode.TRAINER_LOST)} in {trainer_s:.1f} s")
    fault_record["lost"] = ("worker 1's unsent groups (their staleness reservations are released, other workers "
                            "generate in their place); the trainer's work since its last checkpoint")
