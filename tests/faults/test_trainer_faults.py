"""Trainer ranks killed, frozen or diverging under the main job: the work is kept, the cause named.

Real ``python -m launch.train`` runs (the embedded default on CPU, ``experiment=smoke``): one
trainer rank, or two DP ranks. The faults are real signals (SIGKILL, SIGSTOP) to a trainer
process, and one NaN written into a trainer's weights (``inject/sitecustomize.py``). What must
hold: a checkpoint kept without a signal's help (the periodic one of the default policy), named
in the one line that ends the run, and loadable.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.distributed.procs.launcher import wait_for

REPO = Path(__file__).resolve().parents[2]
INJECT = Path(__file__).resolve().parent / "inject"
HB_TIMEOUT_S = 5.0  # experiment=smoke's transport.heartbeat.timeout_s
GRACE_S = 10.0  # cluster.grace_s: the launcher's wait for children after SIGTERM
FROZEN_GRACE_S = 3.0  # a stopped process never leaves on SIGTERM: the launcher waits this long for nothing


def _cmd(run_dir: Path, *overrides: str, grace_s: float = GRACE_S) -> list[str]:
    return [sys.executable, "-m", "launch.train", "experiment=smoke", f"loop.run_dir={run_dir}",
            "transport.control.port=0", "cluster.master_port=0", f"cluster.grace_s={grace_s}", *overrides]


def _start(run_dir: Path, *overrides: str, grace_s: float = GRACE_S) -> tuple[subprocess.Popen, Path]:
    log = run_dir.parent / f"{run_dir.name}.launcher.log"
    out = open(log, "w")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # loop.verbose: the launcher's "started trainer N (pid P)" lines, which name the pids to fault
    proc = subprocess.Popen(_cmd(run_dir, *overrides, "loop.verbose=true", grace_s=grace_s), cwd=REPO, env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    return proc, log


def _run(run_dir: Path, *overrides: str, env: dict | None = None, timeout: float = 600) -> tuple[int, str]:
    proc = subprocess.run(_cmd(run_dir, *overrides), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def _pid(log: Path, name: str) -> int:
    """The pid the launcher logged for ``name`` ("trainer 1")."""
    found = re.findall(rf"started {name} \(pid (\d+)\)", log.read_text())
    assert found, log.read_text()[-3000:]
    return int(found[-1])


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))


def _verdict(text: str) -> str:
    lines = [line for line in text.splitlines() if "run failed" in line]
    assert lines, text[-3000:]
    return lines[-1]


def _stop(proc: subprocess.Popen) -> None:
    """Leave nothing of the run behind: the launcher's tree, each child in its own session (a
    stopped process dies to SIGKILL too)."""
    pids = [proc.pid]
    if proc.poll() is None:
        pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(30)


@pytest.mark.fault(kind="process", name="kill -9 of the trainer mid-run (no signal to checkpoint on)")
def test_a_killed_trainer_leaves_a_periodic_checkpoint_to_resume_from(tmp_path, fault_record):
    """The run's default policy kept a checkpoint before the kill; it is complete (checksums) and the run resumes from it."""
    run = tmp_path / "run"
    proc, log = _start(run, "loop.steps=300")
    try:
        wait_for(lambda: _steps(run) >= 3 or proc.poll() is not None, 300, "three steps", poll=0.2)
        assert proc.poll() is None, log.read_text()[-3000:]
        os.kill(_pid(log, "trainer 0"), signal.SIGKILL)
        code = proc.wait(60)
    finally:
        _stop(proc)
    text = log.read_text()
    assert code != 0 and "trainer 0 exited with code -9" in _verdict(text), text[-3000:]
    trained = _steps(run)
    kept = _checkpoints(run)
    assert kept, f"no checkpoint after {trained} steps: {text[-2000:]}"
    step = int(kept[-1].name.split("_")[1])
    assert 1 <= step <= trained and (kept[-1] / "checksums.json").is_file(), (kept, trained)
    code, out = _run(run, "loop.resume=true", f"loop.steps={step + 2}")
    assert code == 0, out[-3000:]
    assert f"resumed from {kept[-1]} at step {step}" in out, out[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(step + 2))
    fault_record["observed"] = (f"killed after {trained} steps: the checkpoint of step {step} (kept by the "
                                f"default policy: after step 1, then about 67 save times apart) was "
                                f"complete and the run resumed from it to step {step + 2}")
    fault_record["lost"] = f"the {trained - step} step(s) after the checkpoint"


@pytest.mark.fault(kind="process", name="SIGSTOP of trainer rank 1 of two DP ranks")
def test_a_frozen_trainer_rank_is_named_within_the_heartbeat_timeout(tmp_path, fault_record):
    """Rank 0 names the frozen rank within the heartbeat timeout and the run ends non-zero naming the newest checkpoint (complete); nothing is left running."""
    run = tmp_path / "run"
    proc, log = _start(run, "cluster.trainer_ranks=2", "loop.steps=300",
                       f"transport.heartbeat.timeout_s={HB_TIMEOUT_S}", grace_s=FROZEN_GRACE_S)
    frozen = None
    try:
        wait_for(lambda: _steps(run) >= 3 or proc.poll() is not None, 300, "three steps", poll=0.2)
        assert proc.poll() is None, log.read_text()[-3000:]
        frozen = psutil.Process(_pid(log, "trainer 1"))
        frozen.suspend()
        t_stop = time.time()
        reason = run / "logs" / "trainer0.exit"
        wait_for(reason.exists, HB_TIMEOUT_S + 60, "trainer 0 to say why it stopped", poll=0.1)
        named_s = reason.stat().st_mtime - t_stop
        code = proc.wait(FROZEN_GRACE_S + 60)
    finally:
        _stop(proc)
    text = log.read_text()
    verdict = _verdict(text)
    assert code == 3, text[-3000:]
    assert "trainer 0 exited with code 3: trainer rank 0: lost trainer 1 (" in verdict, verdict
    assert f"pid {frozen.pid}" in verdict and "no heartbeat for" in verdict, verdict
    assert named_s <= HB_TIMEOUT_S + 5, named_s  # the beat interval, polling and a loaded 2-core machine
    kept = _checkpoints(run)
    assert kept and f"the newest checkpoint is {kept[-1]} (resume from it" in verdict, (kept, verdict)
    from megatron_darl.checkpoint.checksums import verify_checkpoint

    assert verify_checkpoint(kept[-1]) == ""
    assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE
    fault_record["observed"] = (f"rank 0 named trainer 1 (pid {frozen.pid}) {named_s:.1f} s after SIGSTOP "
                                f"(heartbeat timeout {HB_TIMEOUT_S:g} s) and exited 3 naming {kept[-1].name}; "
                                "the launcher then killed the frozen rank")
    fault_record["lost"] = ("the steps after the newest periodic checkpoint: the survivors cannot write one "
                            "without the frozen rank (a checkpoint is collective)")


@pytest.mark.fault(kind="numerics", name="a weight turns NaN mid-run (loss and gradient norm NaN)")
def test_a_nan_loss_stops_the_run_before_the_weights_spread(tmp_path, fault_record):
    """The step whose loss is NaN is neither published nor checkpointed; the run ends non-zero naming the cause and the last good checkpoint."""
    run = tmp_path / "run"
    code, out = _run(run, "loop.steps=20", env={"PYTHONPATH": f"{INJECT}:{REPO}", "DARL_FAULT": "nan_weight_at:3"})
    verdict = _verdict(out)
    assert code == 1, out[-3000:]
    assert "trainer step 2: loss nan and gradient norm nan" in verdict, verdict
    assert "neither published nor checkpointed" in verdict, verdict
    kept = _checkpoints(run)
    assert [p.name for p in kept] == ["step_000001"], kept  # the periodic one; nothing of the NaN weights
    assert f"the newest checkpoint is {kept[0]}" in verdict, verdict
    assert "Traceback" not in out, out[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert "last weights version loaded 2" in (run / "logs" / "rollout0.log").read_text()  # never version 3
    fault_record["observed"] = ("step 2's loss and gradient norm were NaN: the run stopped with that line, "
                                "version 3 was not published, step_000001 (periodic) stays the newest checkpoint")
    fault_record["lost"] = "step 1 (after the checkpoint) and the diverged step"


@pytest.mark.fault(kind="numerics", name="an update with a finite loss writes NaN weights (Adam eps=0)")
def test_nan_weights_from_a_finite_loss_are_neither_published_nor_saved(tmp_path, fault_record):
    """The weight norm after the update is NaN: the run stops at that step naming it; no worker loads the version, no checkpoint holds it, and resume is not offered a poisoned one."""
    run = tmp_path / "run"
    code, out = _run(run, "loop.steps=8", "trainer.optimizer.adam_eps=0")
    verdict = _verdict(out)
    assert code == 1, out[-3000:]
    # Adam's 0/0 on the weights whose gradient is zero: the loss and the gradient norm are finite
    assert "trainer step 0: weight norm nan: the weights of version 1" in verdict, verdict
    assert "neither published nor checkpointed" in verdict, verdict
    assert f"no checkpoint was written in {run / 'checkpoints'}" in verdict, verdict
    assert not _checkpoints(run) and "Traceback" not in out, (_checkpoints(run), out[-3000:])
    # never version 1: the worker's exit line names what it held when it saw the trainer go; the
    # launcher's SIGTERM after the trainer's failure can end it before that line (a CI run did)
    rollout = (run / "logs" / "rollout0.log").read_text()
    assert re.findall(r"last weights version loaded (-?\d+)", rollout) in ([], ["0"]), rollout[-2000:]
    fault_record["observed"] = ("trainer.optimizer.adam_eps=0: step 0's loss and gradient norm were finite, "
                                "its weight norm NaN; the run stopped with that line, version 1 was never "
                                "published and no checkpoint was written of it")
    fault_record["lost"] = "the diverged step (nothing before it: no checkpoint is poisoned)"
