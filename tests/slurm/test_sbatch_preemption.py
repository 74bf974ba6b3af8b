"""Stopping a real Slurm job: ``scancel`` and the time-limit warning signal leave a checkpoint,
and the run resumes from it (resubmitted with the same OUTPUT_DIR, or requeued by the job).

``scancel`` sends SIGTERM to every job step at once and SIGKILL ``KillWait`` (30 s here, Slurm's
default) later: the trainer finishes its step and checkpoints while the rollout workers, which
defer the signal, keep serving until its stop flag. ``scancel --batch --signal=USR1`` is exactly
what ``#SBATCH --signal=B:USR1@<s>`` delivers ahead of a time limit.
"""

from __future__ import annotations

import re
import time

import pytest
import yaml

from slurm_jobs import (
    CPU_OPTS, job_env, job_info, log_dirs, metrics, sbatch, wait_for, wait_state,
)

pytestmark = pytest.mark.slurm
SCRIPT = "slurm/qwen3_4b_darl.sbatch"


def _checkpoints(run_dir) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_??????"))


def _nodes_idle(cluster) -> bool:
    out = cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
    return len(out) == 4 and out[1] == out[3] == "idle"


def _step_lines(log: str) -> list[int]:
    """The steps a trainer log reports trained, 0-based as in metrics.jsonl (it prints
    ``<variant> step n/N`` counting from 1, as the checkpoints do)."""
    return [int(m) - 1 for m in re.findall(r"INFO \w+ step (\d+)/\d+ reward", log)]


def test_scancel_leaves_a_checkpoint_and_resubmission_resumes(slurm_cluster, warm_policy, tmp_path):
    """Also ``CONVERT=1``: the first job converts the HF policy once, the second reuses it."""
    run, cache = tmp_path / "run", tmp_path / "converted"
    env = job_env(slurm_cluster, MODEL="tiny", MODEL_PATH=warm_policy, CONVERT="1",
                  CONVERT_CACHE=str(cache), OUTPUT_DIR=str(run))
    out = tmp_path / "job-%j.out"
    opts = ["--nodes=2", *CPU_OPTS, f"--output={out}"]
    first = sbatch(slurm_cluster, SCRIPT, ["experiment=smoke", "loop.steps=40"], env, opts)
    first_out = tmp_path / f"job-{first}.out"
    wait_for(lambda: len(metrics(run)) >= 2, 150, "two logged steps of the first job")
    res = slurm_cluster.run(["scancel", str(first)])
    assert res.returncode == 0, res.stderr
    info = wait_state(slurm_cluster, first, timeout=90, output=first_out)
    assert info["JobState"] == "CANCELLED"
    saved = _checkpoints(run)
    assert saved and saved[-1] >= 2, saved  # the step in flight at scancel, checkpointed
    k = saved[-1]
    assert f"stopped at step {k} of 40" in first_out.read_text()
    assert "[slurm] scancel leaves the trainer KillWait=30 s to checkpoint" in first_out.read_text()
    assert "[slurm] trainer: first trained step done " in first_out.read_text()  # where the user looks
    assert "[slurm] converting" in first_out.read_text()
    (converted,) = cache.iterdir()  # <name>-tp1pp1-fp32-<key>, the trainer's initial weights
    assert (converted / "megatron_darl.json").is_file()
    config = yaml.safe_load((run / "run_config.yaml").read_text())
    assert config["trainer"]["init_checkpoint"] == str(converted)
    assert config["loop"]["stop_grace_s"] == 30  # the cluster's KillWait, read by the launcher
    (logs1,) = log_dirs(run)
    assert "exit 0 after" in (logs1 / "rollout-0.log").read_text()  # left on the stop flag

    second = sbatch(slurm_cluster, SCRIPT, ["experiment=smoke", f"loop.steps={k + 2}"], env, opts)
    second_out = tmp_path / f"job-{second}.out"
    info = wait_state(slurm_cluster, second, timeout=150, output=second_out)
    assert info["JobState"] == "COMPLETED", second_out.read_text()[-2000:]
    assert f"[slurm] reusing converted checkpoint {converted}" in second_out.read_text()
    end = second_out.read_text().split("[slurm] done: ")[-1].splitlines()  # the quick start's last lines
    assert end[1].startswith(f"done: {k + 2} steps in ") and end[-1].startswith(f"summary: {run / 'summary.json'}"), end
    logs2 = log_dirs(run)[-1]
    trainer = (logs2 / "trainer-0.log").read_text()
    assert f"resumed from {run / 'checkpoints' / f'step_{k:06d}'} at step {k}" in trainer
    assert _step_lines(trainer) == [k, k + 1]  # the second job trained only after the checkpoint
    assert "resuming after" in (logs2 / "rollout-0.log").read_text()
    assert [r["step"] for r in metrics(run)] == list(range(k + 2))  # one record per step
    assert _checkpoints(run)[-1] == k + 2


def test_warning_signal_checkpoints_and_the_job_requeues_itself(slurm_cluster, warm_policy, tmp_path):
    run = tmp_path / "run"
    steps = 10  # the signal lands after >= 2 steps (0.5 s each here): well before the last
    env = job_env(slurm_cluster, MODEL="tiny", OUTPUT_DIR=str(run), REQUEUE="1")
    out = tmp_path / "job.out"
    opts = ["--nodes=2", *CPU_OPTS, f"--output={out}", "--open-mode=append"]
    # no end checkpoint: the requeued job must still see that it finished, not ask for a resubmission
    job = sbatch(slurm_cluster, SCRIPT, ["experiment=smoke", f"loop.steps={steps}", "loop.save_at_end=false"],
                 env, opts)
    wait_for(lambda: len(metrics(run)) >= 2, 150, "two logged steps")
    res = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
    assert res.returncode == 0, res.stderr
    info = wait_state(slurm_cluster, job, timeout=90, states={"PENDING"}, output=out)
    assert info["Restarts"] == "1"
    # Slurm holds a requeued job (BeginTime, ~2 min) so that its next start is not refused as a
    # revoked credential of the instance just killed. Start it early, but only once the nodes are
    # idle and a clock second has passed (credential times have one-second resolution).
    wait_for(lambda: _nodes_idle(slurm_cluster), 60, "the nodes to be idle after the requeue")
    time.sleep(2.0)
    res = slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    assert res.returncode == 0, res.stderr
    info = wait_state(slurm_cluster, job, timeout=150, output=out)
    assert info["JobState"] == "COMPLETED", out.read_text()[-2000:]
    text = out.read_text()
    k = int(re.search(rf"checkpointed at step (\d+) of {steps}: requeueing", text).group(1))
    assert 2 <= k < steps
    assert f"job {job} (restart 1)" in text and f"[slurm] done: {run} ({steps} steps)" in text
    assert "resubmit" not in text.split("(restart 1)")[-1]
    assert k in _checkpoints(run) and _checkpoints(run)[-1] < steps  # the stop saved; the end did not
    first, second = log_dirs(run)
    assert (first.name, second.name) == (f"job{job}_0", f"job{job}_1")
    assert _step_lines((second / "trainer-0.log").read_text()) == list(range(k, steps))
    assert [r["step"] for r in metrics(run)] == list(range(steps))
    assert job_info(slurm_cluster, job)["Restarts"] == "1"
