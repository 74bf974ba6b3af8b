"""Run directories shared, cut short or resumed with another config.

Real ``python -m launch.train experiment=smoke`` runs on CPU (trainer and rollout worker
processes); refusals that happen before any child starts run ``launch.train.main`` in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from launch import train
from tests.distributed.procs.launcher import wait_for

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["experiment=smoke", "transport.control.port=0", "cluster.master_port=0", "cluster.grace_s=10",
         "loop.receive_timeout_s=60"]  # a hang fails within a minute, not the default 10


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "launch.train", *SMOKE, f"loop.run_dir={run_dir}", *overrides]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _run(run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(run_dir, *overrides), cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _refusal(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("launch.train:")]


@pytest.mark.fault(kind="process", name="a second run on a run dir in use; the first one's launcher SIGKILLed")
def test_a_second_run_on_a_busy_run_dir_is_refused_and_a_dead_holder_taken_over(tmp_path, fault_record):
    """The second launcher exits 2 in one line naming the holder (host, pid, start) and leaves the dir as it was; once the first run's launcher is SIGKILLed and its children are gone, a resume (with an allowed config change) takes the stale lock over, says so, keeps the old config as history and continues."""
    run_dir = tmp_path / "run"
    log = open(tmp_path / "a.log", "w")
    a = subprocess.Popen(_cmd(run_dir, "loop.steps=500"), cwd=REPO, env=_env(), stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: len(_rows(run_dir / "metrics.jsonl")) >= 1, 300, "a step of run a", poll=0.5)
        config = (run_dir / "run_config.yaml").read_bytes()
        t0 = time.monotonic()
        b = _run(run_dir, "loop.steps=3", timeout=120)
        b_seconds = time.monotonic() - t0
        assert b.returncode == 2, b.stdout[-2000:] + b.stderr[-2000:]
        refusal = _refusal(b.stderr)
        assert len(refusal) == 1 and "Traceback" not in b.stderr, b.stderr[-3000:]
        assert f"is in use by another run: host {os.uname().nodename} pid {a.pid}" in refusal[0], refusal
        assert (run_dir / "run_config.yaml").read_bytes() == config  # b wrote nothing
        children = [c.pid for c in psutil.Process(a.pid).children(recursive=True)]
        os.kill(a.pid, signal.SIGKILL)  # no say for the launcher: its record stays behind
        a.wait(10)
        wait_for(lambda: not [p for p in children if psutil.pid_exists(p) and
                              psutil.Process(p).status() != psutil.STATUS_ZOMBIE], 60,
                 "run a's children to leave", poll=0.2)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        log.close()
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert saved, (tmp_path / "a.log").read_text()[-3000:]
    step = int(saved[-1].name.split("_")[1])
    c = _run(run_dir, "loop.resume=true", f"loop.steps={step + 1}")  # an allowed change: 500 -> step + 1
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    assert f"took over the stale lock of host {os.uname().nodename} pid {a.pid}" in c.stderr
    assert "(its process is gone)" in c.stderr
    assert f"allowed config change(s): loop.steps: 500 -> {step + 1}" in c.stderr
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")][-1] == step
    assert (run_dir / f"run_config.until_step_{step:06d}.yaml").read_bytes() == config  # history kept
    assert OmegaConf.load(run_dir / "run_config.yaml").loop.steps == step + 1
    assert (run_dir / "run.lock").read_text() == ""  # released at the end
    fault_record["observed"] = (f"second launcher: exit 2 in {b_seconds:.1f} s, '{refusal[0][:160]}...'; after "
                                f"SIGKILL of the first launcher its children left, a resume (loop.steps "
                                f"500 -> {step + 1}, allowed) took the stale lock over, said so, kept the old "
                                f"run_config.yaml as history and trained step {step}")


@pytest.mark.fault(kind="file", name="only a partial checkpoint write (step_*.tmp) in the run dir")
def test_a_partial_checkpoint_is_no_resume_point_and_history_is_kept(tmp_path, fault_record):
    """Launcher and loop agree there is no resume point: the run starts at step 0 (said, naming the partial write) and trains instead of deadlocking; the earlier metric records are kept, not truncated."""
    run_dir = tmp_path / "run"
    partial = run_dir / "checkpoints" / "step_000002.tmp"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"\0" * 64)  # a write cut off before its marker
    earlier = [{"step": s, "reward_mean": 0.1 * s, "version": float(s + 1)} for s in range(2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    t0 = time.monotonic()
    proc = _run(run_dir, "loop.resume=true", "loop.steps=1")
    seconds = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "step_000002.tmp incomplete" in out and "holds no complete checkpoint: the run starts at step 0" in out
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0] and all("loss" in r for r in rows)  # this run's step
    kept = _rows(run_dir / "metrics.superseded.jsonl")
    assert [(r["step"], r["reward_mean"]) for r in kept] == [(0, 0.0), (1, 0.1)]  # the earlier ones
    assert (run_dir / "checkpoints" / "step_000001" / "megatron_darl.json").is_file()
    fault_record["observed"] = (f"run started at step 0 and finished its step in {seconds:.0f} s (was: workers "
                                "waited for resumed weights until the receive timeout); the 2 earlier "
                                "records moved to metrics.superseded.jsonl")


def _checkpointed(run_dir: Path) -> Path:
    """What a finished 2-step smoke run leaves as far as the launcher looks: run_config.yaml as
    launch.train writes it, two metric records, and checkpoint step_000002 with its completion
    marker (completeness is judged by name and marker, never contents: megatron_darl/checkpoint/resume_points.py)."""
    from launch.config import load_run_config, save_run_config

    cfg = train.prepare(load_run_config([*SMOKE, f"loop.run_dir={run_dir}", "loop.steps=2"]))
    save_run_config(cfg, run_dir / "run_config.yaml")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(2)))
    ckpt = run_dir / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "megatron_darl.json").write_text("{}\n")
    return run_dir


REFUSED = {  # override -> what the one line must say
    "replay.k": ("replay.k=2", "replay.k changed from 4 to 2"),
    "algorithm": ("algorithm=sync", "algorithm.variant changed from 'darl' to 'sync'"),
    "workers": ("cluster.rollout_workers=2", "cluster.rollout_workers changed from 1 to 2"),
    "group size": ("algorithm.group_size=2", "algorithm.group_size changed from 4 to 2"),
    "prompt seed": ("sampling.seed=7", "sampling.seed changed from 0 to 7"),
}


@pytest.mark.fault(kind="config", name="resume with a changed config")
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_resume_with_a_refused_change_names_it_and_changes_nothing(tmp_path, capsys, case, fault_record):
    """A change the checkpoint's state cannot take: exit 2 before any process starts, one line naming key, old and new value; run_config.yaml and metrics.jsonl stay as they were."""
    run_dir = _checkpointed(tmp_path / "run")
    before = {name: (run_dir / name).read_bytes() for name in ("run_config.yaml", "metrics.jsonl")}
    override, needle = REFUSED[case]
    code = train.main([*SMOKE, f"loop.run_dir={run_dir}", "loop.resume=true", "loop.steps=2", override])
    refusal = _refusal(capsys.readouterr().err)
    assert code == 2 and len(refusal) == 1 and needle in refusal[0], (code, refusal)
    assert "refused" in refusal[0] and str(run_dir / "run_config.yaml") in refusal[0]
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    assert not list(run_dir.glob("run_config.until_*"))
    fault_record["observed"] = refusal[0].replace(str(run_dir), "<run>")[:240]




_LAUNCHER = """
import subprocess, sys, time
from launch.run_lock import RunLock
lock = RunLock.acquire(sys.argv[1])
trainer = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], pass_fds=(lock.fd,))
print(trainer.pid, flush=True)
time.sleep(600)
"""
# a trainer rank as launch.lifeline.start_child begins it, then a save's forked writer that hangs
# (megatron-core's dist_checkpointing forks its writers with this context)
_TRAINER = """
import multiprocessing, sys, time
from launch.run_lock import fence_forks
fence_forks(sys.argv[1])
writer = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), name="ckpt-writer")
writer.start()
print(writer.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.fault(kind="process", name="launcher and trainer killed while a forked checkpoint writer runs")
def test_a_forked_writer_dies_with_its_trainer_and_frees_the_run_lock(tmp_path, fault_record):
    """While the trainer lives, a launch is refused naming the lock's holders with pid and command line; once it is SIGKILLed its forked writer dies too, and the next launch takes the stale lock over with a log line."""
    from launch.run_lock import RunDirBusy, RunLock

    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(run_dir), _TRAINER], cwd=REPO, env=_env(),
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids = []
    try:
        trainer = int(launcher.stdout.readline())
        pids.append(trainer)
        wait_for(lambda: len(psutil.Process(trainer).children()) == 1, 60, "the trainer's writer", poll=0.1)
        writer = psutil.Process(trainer).children()[0].pid
        pids.append(writer)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        with pytest.raises(RunDirBusy) as busy:
            RunLock.acquire(run_dir)
        refused = str(busy.value)
        assert f"pid {launcher.pid} has exited, processes it started still hold the lock" in refused, refused
        assert f"held by pid {trainer} ({sys.executable} -c " in refused and "fence_forks" in refused, refused
        assert f"pid {writer} " not in refused  # the writer closed its copy of the lock at the fork
        os.kill(trainer, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(writer) or psutil.Process(writer).status() == psutil.STATUS_ZOMBIE,
                 10, "the writer to die with its trainer", poll=0.1)
        said = []
        with RunLock.acquire(run_dir, say=said.append):
            pass
    finally:
        for pid in [launcher.pid] + pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert len(said) == 1 and f"took over the stale lock of host {os.uname().nodename} pid {launcher.pid}" in said[0]
    fault_record["observed"] = (f"refused while the trainer lived: '...{refused.split('; ', 1)[-1][:160]}...'; "
                                "after SIGKILL of launcher and trainer the forked writer died with the trainer "
                                "and the next launch took the lock over")
