"""Faults of the local launcher: two runs on one machine, a SIGKILLed launcher.

Real ``python -m launch.train`` runs (the embedded default on CPU, ``experiment=smoke``), with
the launcher's own defaults for ports: nothing is pinned by the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.distributed.procs.launcher import wait_for

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 30.0  # cluster.grace_s of the runs: SIGTERM -> SIGKILL once the launcher is gone
# Two runs on two cores: a trainer's store thread was seen silent for 5 s at start-up (smoke's
# timeout) with both runs loading at once, and each rollout worker left. The default 10 s here;
# the grace covers a trainer that notices its lost worker only then and checkpoints.
HB_TIMEOUT_S = 10.0


def _start(run_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch.train", "experiment=smoke", f"loop.run_dir={run_dir}",
           "loop.steps=500", f"cluster.grace_s={GRACE_S}", "loop.checkpoint_interval=0",
           f"transport.heartbeat.timeout_s={HB_TIMEOUT_S}"]
    log = open(run_dir.parent / f"{run_dir.name}.launcher.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def _tree(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


@pytest.mark.fault(kind="process", name="launcher SIGKILLed, a second run on the same machine")
def test_two_runs_at_once_and_a_sigkilled_launchers_children_leave(tmp_path, fault_record):
    """Two runs with default ports train side by side; SIGKILL of one launcher: its trainer checkpoints and all its children exit, the other run goes on."""
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    run_a.mkdir(), run_b.mkdir()
    a, b = _start(run_a), _start(run_b)
    try:
        wait_for(lambda: _steps(run_a) >= 1 and _steps(run_b) >= 1, 300, "a step of both runs", poll=0.5)
        children = _tree(a.pid)
        assert len(children) >= 2, children  # trainer and rollout worker (and their helpers)
        t_kill = time.monotonic()
        os.kill(a.pid, signal.SIGKILL)
        a.wait(10)
        wait_for(lambda: not _alive(children), GRACE_S + 15, "every child of the killed launcher to exit",
                 poll=0.2)
        gone_s = time.monotonic() - t_kill
        b_steps = _steps(run_b)
        wait_for(lambda: _steps(run_b) >= b_steps + 1, 120, "run b to go on", poll=0.5)
        b.send_signal(signal.SIGTERM)
        assert b.wait(120) == 128 + signal.SIGTERM
    finally:
        for proc in (a, b):
            for pid in [proc.pid] + (_tree(proc.pid) if proc.poll() is None else []):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    logs = (tmp_path / "a.launcher.log").read_text()
    assert list((run_a / "checkpoints").glob("step_*")), logs[-3000:]  # the graceful path ran
    assert list((run_b / "checkpoints").glob("step_*"))
    assert "signal 15: checkpointing after this step" in logs  # the parent-death signal, as SIGTERM
    fault_record["observed"] = (f"both runs trained at once on ports they picked; after SIGKILL of run a's "
                                f"launcher its {len(children)} children exited in {gone_s:.1f} s, run a "
                                f"checkpointed at step {_steps(run_a)}, run b went on and stopped on SIGTERM")
    fault_record["lost"] = "nothing: run a checkpointed on its way out (resume with loop.resume=true)"
