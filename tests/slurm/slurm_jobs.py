"""Helpers of the slurm tier: submit the real sbatch scripts, read job state, wait with a timeout.

Everything goes through Slurm's own clients (sbatch, scontrol, scancel) against the
``LocalSlurm`` cluster; no scheduler behaviour is mocked. The cluster has no accounting
database (no slurmdbd), so job state comes from ``scontrol show job`` (kept for ``MinJobAge``)
and step placement from the launcher's ``steps.txt`` (``squeue -s`` while the job ran) and the
first line of each task's log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
KNOBS = ("MODEL", "MODEL_PATH", "ALGORITHM", "DATA", "DATA_PATH", "ROLLOUT", "TRAINER", "OUTPUT_DIR",
         "RESUME", "TRAINER_NODES", "ROLLOUT_NODES", "GPUS_PER_NODE", "TRAINER_GPUS_PER_NODE", "TP", "PP",
         "ENGINE", "TRAIN_NODES", "TRAIN_GPUS_PER_NODE",  # not knobs: set, they stop the job
         "ROLLOUT_TP", "THREADS", "CONVERT", "CONVERT_CACHE", "CONVERT_DTYPE", "REQUEUE", "GRACE_S",
         "TRAINER_PORT", "STORE_PORT", "NET_IFNAME", "STEP_MEM", "DARL_ROOT", "NODES_LIST", "SCRIPT",
         "STUDY_DIR", "SBATCH_ARGS", "REPORT_ARGS", "WAIT", "RANK", "WORLD_SIZE", "MASTER_ADDR",
         "MASTER_PORT")
CPU_OPTS = ("--gpus-per-node=0",)  # the emulated nodes have no GPU: the scripts ask for 8


def job_env(cluster, **knobs: str) -> dict[str, str]:
    """The cluster's client environment, this venv's python, and only the given knobs."""
    env = {k: v for k, v in cluster.env.items() if k not in KNOBS}
    env["DARL_PYTHON"] = sys.executable
    env.update({k: str(v) for k, v in knobs.items()})
    return env


def sbatch(cluster, script: str, args: list[str], env: dict[str, str], opts: list[str]) -> int:
    """Submit ``script`` from the repository root; the job id."""
    res = subprocess.run(["sbatch", "--parsable", *opts, script, *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"sbatch {script} failed: {res.stderr}"
    return int(res.stdout.strip().split(";")[0])


def job_info(cluster, job_id: int) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (JobState, NodeList, Restarts, ...)."""
    res = cluster.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
    assert res.returncode == 0, f"scontrol show job {job_id}: {res.stderr}"
    return dict(tok.split("=", 1) for tok in res.stdout.split() if "=" in tok)


def wait_for(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.5):
    """Poll ``predicate`` until it returns a true value; AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_state(cluster, job_id: int, timeout: float, states=TERMINAL, output: Path | None = None) -> dict:
    """Wait until the job is in one of ``states``; the failure message carries its output."""
    try:
        return wait_for(lambda: (lambda i: i if i["JobState"] in states else None)(job_info(cluster, job_id)),
                        timeout, f"job {job_id} to reach {sorted(states)}", poll=1.0)
    except AssertionError as err:
        tail = output.read_text()[-3000:] if output is not None and output.exists() else ""
        raise AssertionError(f"{err}; state {job_info(cluster, job_id)['JobState']}\n{tail}") from None


def metrics(run_dir: Path) -> list[dict]:
    """The run's training-step records (held-out points, ``kind: heldout``, left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [r for r in rows if r.get("kind") != "heldout"]


def log_dirs(run_dir: Path) -> list[Path]:
    """Per job (and restart) log directories of a run, oldest first."""
    return sorted((Path(run_dir) / "logs").glob("job*_*"), key=lambda p: p.stat().st_mtime)


def task_header(log: Path) -> dict[str, str]:
    """The ``[slurm] role=... node=...`` line slurm/task.sh writes first, as a dict."""
    first = log.read_text().splitlines()[0]
    assert first.startswith("[slurm] role="), f"{log}: first line {first!r}"
    return dict(tok.split("=", 1) for tok in first.split()[1:] if "=" in tok)


def steps_table(log_dir: Path) -> dict[str, tuple[str, str]]:
    """``steps.txt`` (squeue -s while the job ran): step name -> (step id, node list)."""
    rows = [line.split() for line in (log_dir / "steps.txt").read_text().splitlines() if line.strip()]
    return {name: (step, nodes) for step, name, nodes in rows}
