"""The sbatch scripts on a GPU host under a real Slurm (gpu/slurm_run.sh calls this):
the host's GPUs split over emulated nodes, a run submitted as a user submits it, stopped with
``scancel`` mid-run and resubmitted to resume, with the timeline a user would see.

    python gpu/slurm_case.py headline --model qwen3_4b --nodes 2 --steps 40 --cancel-at 3
    python gpu/slurm_case.py scaling --model qwen3_1.7b --nodes-list "1 2" --steps 12 \
        algorithm.groups_per_step=32 sampling.max_new_tokens=1024 worker.groups_per_batch=16
    python gpu/slurm_case.py headline --model tiny --engine hf experiment=smoke   # CPU check

``headline``: ``slurm/<model>_darl.sbatch`` on ``--nodes`` emulated nodes (the host's GPUs split
evenly: 4 GPUs, 2 nodes -> gpu:2 each; ``LocalSlurm(split_host_gpus=True)``), a random-init policy
of the model's shape with the built-in task's tokenizer, ``ROLLOUT_NODES`` (default: launch.sh's
half the nodes); ``scancel`` once the run has logged ``--cancel-at`` steps (``--stop graceful``:
``scancel --batch --signal=USR1``, no KillWait deadline), then the same command again with the same
OUTPUT_DIR. Checked from the run's files: a checkpoint at the stop, the second
job resumed from it, trained only the steps after it, and ``metrics.jsonl`` has one record per
step. ``scaling``: ``slurm/scaling_study.sh`` at each node count of ``--nodes-list`` and its report.
Everything it found goes to ``--out`` (``summary.json``, the batch outputs and the trainer's log
tails) so the device call brings it back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "slurm")]

from local_cluster import LocalSlurm  # noqa: E402
from slurm_jobs import job_env, log_dirs, metrics, sbatch, wait_for, wait_state  # noqa: E402

WORK = Path("/tmp/darl_slurm")
# A random-init policy earns no reward, so every group is degenerate, dropped on arrival, and a
# step trains nothing: the study's runs keep them (as benchmarks/loop_profile.py does), so what it
# measures is the trainer's work. The headline keeps the script's defaults: it checks the stop
# and the resume, not the rates.
RANDOM_POLICY = ["replay.drop_degenerate=false"]


def gpus_on_host() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    return len([line for line in out.splitlines() if line.startswith("GPU ")])


def device_files(gpus: int) -> str:
    """The folder of the ``nvidia<k>`` files gres.conf names: /dev when the host has one per GPU,
    else character devices made for it (a container may expose its GPUs without them; Slurm only
    checks the files, and ``CUDA_VISIBLE_DEVICES`` does the binding)."""
    if all(Path(f"/dev/nvidia{k}").exists() for k in range(gpus)):
        return "/dev"
    folder = WORK / "dev"
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(gpus):
        if not (folder / f"nvidia{k}").exists():
            os.mknod(folder / f"nvidia{k}", 0o600 | stat.S_IFCHR, os.makedev(195, k))
    print(f"/dev lacks nvidia0-{gpus - 1}: gres.conf names the device files made in {folder}", flush=True)
    return str(folder)


def start_cluster(nodes: int, gpus_per_node: int) -> LocalSlurm:
    root = WORK / "cluster"
    shutil.rmtree(root, ignore_errors=True)
    cluster = LocalSlurm(root, nodes=nodes, cpus_per_node=max(2, (os.cpu_count() or 2) // nodes),
                         memory_mb=100_000, gpus=gpus_per_node, split_host_gpus=nodes > 1,
                         gpu_device_dir=device_files(nodes * gpus_per_node),
                         plugin_dir=os.environ.get("DARL_SLURM_PLUGIN_DIR", ""),
                         slurmd_debug="debug2")  # each pid a step's signal reaches, or skips
    cluster.start(timeout=90)
    return cluster


def build_policy(model: str) -> Path:
    """A random-init policy of ``model``'s shape; ``tiny``: the embedded default's warm policy."""
    if model == "tiny":
        from launch.warmstart import ensure_warm_policy
        from megatron_darl.models.config import WarmStartConfig

        return Path(ensure_warm_policy(WarmStartConfig(), log=lambda m: None))
    from benchmarks.loop_profile import build_policy as build

    return build(model, WORK / f"policy_{model}")


def trained_steps(log: Path) -> list[int]:
    """Steps (0-based, as in metrics.jsonl) the trainer's log reports as trained: its lines
    ``<variant> step n/N`` or, with the progress bar (under Slurm), the bar's counts ``| n/N [``
    past the one it started at (a resumed run's bar starts at the checkpoint's step)."""
    if not log.exists():
        return []
    text = log.read_text()
    lines = [int(m) - 1 for m in re.findall(r" step (\d+)/\d+ reward", text)]
    counts = [int(m) for m in re.findall(r"\| *(\d+)/\d+ \[", text)]
    bar = sorted({n - 1 for n in counts if n > counts[0]}) if counts else []
    return lines or bar


def script_of(model: str) -> tuple[str, dict[str, str]]:
    """The sbatch script a case submits and the knobs it needs for ``model``: the model's D-ARL
    script (``tiny``, the CPU check: the 4B one, with ``MODEL=tiny``)."""
    if model == "tiny":
        return "slurm/qwen3_4b_darl.sbatch", {"MODEL": "tiny"}
    return f"slurm/{model}_darl.sbatch", {}


def headline(a: argparse.Namespace, cluster: LocalSlurm, out: Path) -> dict:
    policy = build_policy(a.model)
    script, model_knobs = script_of(a.model)
    run = WORK / "run_headline"
    shutil.rmtree(run, ignore_errors=True)
    knobs = {"MODEL_PATH": str(policy), "OUTPUT_DIR": str(run), "DATA": "builtin", "ROLLOUT": a.engine,
             "DARL_PYTHON": sys.executable, "GRACE_S": "60", **model_knobs}
    if a.rollout_nodes is not None:
        knobs["ROLLOUT_NODES"] = str(a.rollout_nodes)
    env = job_env(cluster, **knobs)
    opts = [f"--nodes={a.nodes}", f"--gpus-per-node={cluster.gpus}", "--time=30", "--exclusive"]
    overrides = [*a.overrides, "loop.checkpoint_interval=0"]
    t0 = time.time()
    first = sbatch(cluster, script, [*overrides, f"loop.steps={a.steps}"], env,
                   [*opts, f"--output={out}/job1.out"])
    result: dict = {"script": script, "nodes": a.nodes, "gpus_per_node": cluster.gpus, "first_job": first}
    wait_for(lambda: len(metrics(run)) >= 1 or _ended(cluster, first), a.timeout, "the first trained step")
    result["submit_to_first_step_s"] = time.time() - t0
    wait_for(lambda: len(metrics(run)) >= a.cancel_at or _ended(cluster, first), a.timeout,
             f"{a.cancel_at} logged steps")
    (out / "processes_before_stop.txt").write_text(process_table() + gpu_memory_table())  # signal caught? GPU room?
    t_cancel = time.time()
    result["cancel_s"] = t_cancel - t0
    cluster.run(["scancel", *(["--batch", "--signal=USR1"] if a.stop == "graceful" else []), str(first)])
    info = wait_state(cluster, first, timeout=300, output=out / "job1.out")
    result["first_state"] = info["JobState"]
    result["cancel_to_end_s"] = time.time() - t_cancel
    saved = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_??????"))
    result["checkpoints_after_cancel"] = saved
    if not saved:
        keep_logs(run, out)
        return {**result, "ok": False, "why": f"no checkpoint after scancel ({a.stop}); see job1_trainer-0.log"}
    k = saved[-1]
    t1 = time.time()
    # --no-end-checkpoint: the resumed job skips its final save (a 4B one was 131 s, the stop's
    # save already timed it); the job then ends "stopped at step k" with its steps all trained
    end = [] if a.end_checkpoint else ["loop.save_at_end=false"]
    second = sbatch(cluster, script, [*overrides, *end, f"loop.steps={a.steps}"], env,
                    [*opts, f"--output={out}/job2.out"])
    wait_for(lambda: len(metrics(run)) > k or _ended(cluster, second), a.timeout, "the first step after resuming")
    result["resubmit_to_first_step_s"] = time.time() - t1
    info = wait_state(cluster, second, timeout=a.timeout, output=out / "job2.out")
    result.update(second_job=second, second_state=info["JobState"], resubmit_to_end_s=time.time() - t1)
    logs = keep_logs(run, out)
    second_trained = trained_steps(logs[-1] / "trainer-0.log") if logs else []
    steps = [r["step"] for r in metrics(run)]
    result.update(resumed_at=k, second_trained=second_trained, metric_steps=steps,
                  ok=(info["JobState"] == "COMPLETED" and steps == list(range(len(steps)))  # none twice
                      and len(steps) == a.steps and bool(second_trained) and min(second_trained) >= k))
    shutil.copy(run / "metrics.jsonl", out / "metrics.jsonl")
    return result


def process_table() -> str:
    """Every process, as a step's signal sees it: pid, parent, state, name (``comm``: a name with a
    space hides a process and its children from proctrack/linuxproc's tree walk), the blocked,
    ignored and caught signal masks (SIGUSR1 is bit 9, SIGTERM bit 14) and the command line."""
    rows = ["pid ppid state comm SigBlk SigIgn SigCgt cmdline"]
    for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            stat_line = (proc / "stat").read_text()
            status = dict(line.split(":\t", 1) for line in (proc / "status").read_text().splitlines()
                          if ":\t" in line)
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue  # gone meanwhile
        comm = stat_line[stat_line.index("(") + 1:stat_line.rindex(")")]
        state, ppid = stat_line[stat_line.rindex(")") + 2:].split()[:2]
        rows.append(f"{proc.name} {ppid} {state} {comm!r} {status.get('SigBlk', '?').strip()} "
                    f"{status.get('SigIgn', '?').strip()} {status.get('SigCgt', '?').strip()} {cmd}")
    return "\n".join(rows) + "\n"


def gpu_memory_table() -> str:
    """Each process's memory on each GPU (``nvidia-smi``), "" without one: whether the trainer's
    parameter snapshots found room is judged against what other processes hold on its device."""
    if not shutil.which("nvidia-smi"):
        return ""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60).stdout
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=60).stdout
    return f"\n# GPUs (index, uuid, used, total)\n{gpus}# compute processes (pid, gpu uuid, used)\n{out}"


def keep_logs(run: Path, out: Path) -> list[Path]:
    """Each job's log folder under ``run``, its logs' tails and step list copied to ``out``."""
    logs = log_dirs(run)
    for i, d in enumerate(logs):
        for f in d.glob("*.log"):
            (out / f"job{i + 1}_{f.name}").write_text(f.read_text(errors="replace")[-20000:])
        if (d / "steps.txt").exists():
            shutil.copy(d / "steps.txt", out / f"job{i + 1}_steps.txt")
    return logs


def _ended(cluster: LocalSlurm, job: int) -> bool:
    return not cluster.run(["squeue", "-h", "-j", str(job)]).stdout.strip()


def scaling(a: argparse.Namespace, cluster: LocalSlurm, out: Path) -> dict:
    policy = build_policy(a.model)
    script, model_knobs = script_of(a.model)
    study = WORK / "study"
    shutil.rmtree(study, ignore_errors=True)
    budget = a.timeout * len(a.nodes_list.split())  # the runs take the nodes one after the other
    env = job_env(cluster, MODEL_PATH=str(policy), DATA="builtin", ROLLOUT=a.engine, DARL_PYTHON=sys.executable,
                  NODES_LIST=a.nodes_list, SCRIPT=script, STUDY_DIR=str(study),
                  SBATCH_ARGS=f"--gpus-per-node={cluster.gpus} --time=30", WAIT="1",
                  WAIT_TIMEOUT_S=str(int(budget)), **model_knobs)
    res = subprocess.run(["bash", "slurm/scaling_study.sh", *RANDOM_POLICY, *a.overrides, f"loop.steps={a.steps}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=budget + 60)
    (out / "scaling_study.out").write_text(res.stdout[-20000:] + res.stderr[-5000:])
    for f in (study / "report").glob("*"):
        if f.is_file():
            shutil.copy(f, out / f"report_{f.name}")
    for f in study.glob("*.out"):  # each run's batch output, kept whether or not the study finished
        shutil.copy(f, out / f"study_{f.name}")
    try:  # the report's rows (samples/s, step seconds by node count): the study's result
        rows = json.loads((study / "report" / "scaling.json").read_text())
    except (OSError, ValueError):
        rows = []
    wanted = sorted(int(n) for n in a.nodes_list.split())
    got = sorted(int(r.get("nodes", -1)) for r in rows) if isinstance(rows, list) else []
    return {"rc": res.returncode, "nodes_list": a.nodes_list, "rows": rows,
            "ok": res.returncode == 0 and got == wanted}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case", choices=["headline", "scaling"])
    p.add_argument("--model", default="qwen3_4b")
    p.add_argument("--engine", default="vllm")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (headline)")
    p.add_argument("--rollout-nodes", type=int, default=None)
    p.add_argument("--nodes-list", default="1 2", help="node counts (scaling)")
    p.add_argument("--steps", type=int, default=40,
                   help="steps of a run: at a random init a step takes 1-2 s at 1.7B and 4B, so 12 ended "
                        "before a stop sent at step 3 had reached the trainer")
    p.add_argument("--cancel-at", type=int, default=3)
    p.add_argument("--stop", choices=["scancel", "graceful"], default="scancel",
                   help="scancel: SIGTERM to every step, SIGKILL KillWait later; graceful: "
                        "scancel --batch --signal=USR1 (the launcher stops the trainer, no deadline)")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds a job may take (scaling: each run)")
    p.add_argument("--no-end-checkpoint", dest="end_checkpoint", action="store_false",
                   help="headline: the resumed job writes no final checkpoint (device time)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/darl_slurm_out")))
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the runs")
    a = p.parse_intermixed_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    nodes = a.nodes if a.case == "headline" else max(int(n) for n in a.nodes_list.split())
    gpus = gpus_on_host()
    if gpus % nodes:
        raise SystemExit(f"{gpus} GPUs do not split over {nodes} emulated nodes")
    cluster = start_cluster(nodes, gpus // nodes)
    try:
        result = (headline if a.case == "headline" else scaling)(a, cluster, a.out)
    finally:
        cluster.cancel_all()
        cluster.stop()
        for log in (cluster.root / "log").glob("*.log"):
            shutil.copy(log, a.out / f"slurm_{log.name}")
    (a.out / "summary.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
