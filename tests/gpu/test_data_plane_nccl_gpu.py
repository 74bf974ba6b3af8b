"""NCCL data-plane groups between two GPUs: ``build_group`` returns only once every member has
constructed the group, and a member that never constructs it costs the others the connect
timeout, not a hang. NCCL builds its communicator at the first collective with no deadline of its
own, so a worker killed between agreeing to a pair (or a weight-sync plan) and building it would
otherwise stop the hub's link or the weight-sync leader for good. Real processes, one GPU each,
over the run's store served by this test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _member(port: int, name: str, rank: int, size: int, timeout_s: float) -> None:
    """One member (run as its own process): build the group, broadcast from rank 0, print JSON."""
    from megatron_darl.transport.config import ControlPlaneConfig
    from megatron_darl.transport.process_group import build_group
    from megatron_darl.transport.store import TransportTimeout, connect_store

    torch.cuda.set_device(0)  # each process sees one GPU
    store = connect_store(ControlPlaneConfig(port=port, store_timeout_s=60), who=f"member {rank}")
    start = time.monotonic()
    out: dict = {"rank": rank}
    try:
        group = build_group(store, name, rank, size, "nccl", timeout_s)
        out["built_s"] = time.monotonic() - start
        data = torch.arange(1024, dtype=torch.float32, device="cuda") * (1 if rank == 0 else 0)
        group.broadcast(data, 0, "test tensor")
        out["sum"] = float(data.sum().item())
    except TransportTimeout as exc:
        out["error"], out["error_s"] = str(exc), time.monotonic() - start
    print("RESULT " + json.dumps(out), flush=True)


def _spawn(port: int, name: str, rank: int, size: int, timeout_s: float, gpu: int) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, __file__, str(port), name, str(rank), str(size), str(timeout_s)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _result(proc: subprocess.Popen, limit_s: float) -> dict:
    """The member's JSON line, once its process ended (it must end within ``limit_s``)."""
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"member did not exit within {limit_s} s:\n{out[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture()
def store_port():
    from megatron_darl.transport.config import ControlPlaneConfig
    from megatron_darl.transport.store import serve_store
    from tests.distributed.procs.launcher import free_port

    port = free_port()
    server = serve_store(ControlPlaneConfig(port=port, store_timeout_s=60))
    yield port
    del server


def test_both_members_connect_when_built_and_a_broadcast_delivers(store_port):
    procs = [_spawn(store_port, "ws/test/both", r, 2, 60.0, gpu=r) for r in range(2)]
    results = [_result(p, 120) for p in procs]
    expected = float(sum(range(1024)))
    for res in results:
        assert "error" not in res, res
        assert res["sum"] == expected, res
    print("build seconds:", [round(r["built_s"], 2) for r in results])


@pytest.mark.parametrize("present", [0, 1], ids=["root_alone", "member_alone"])
def test_a_member_that_never_builds_costs_the_connect_timeout_not_a_hang(store_port, present):
    timeout_s = 8.0
    proc = _spawn(store_port, f"ws/test/alone{present}", present, 2, timeout_s, gpu=present)
    res = _result(proc, 90)
    assert "error" in res, res
    assert "NCCL connect did not finish within 8 s" in res["error"], res["error"]
    assert f"rank {present}/2" in res["error"] and f"ws/test/alone{present}" in res["error"], res["error"]
    assert timeout_s <= res["error_s"] < timeout_s + 10, res


if __name__ == "__main__":
    port, name, rank, size, timeout = sys.argv[1:6]
    _member(int(port), name, int(rank), int(size), float(timeout))
