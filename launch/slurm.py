"""``python -m launch.slurm prepare --plan FILE [hydra overrides]``: one Slurm job's plan.
``python -m launch.slurm latest-step --run-dir DIR``: the step its newest resume point holds.
``python -m launch.slurm trained-steps --run-dir DIR``: how many steps its ``summary.json`` counts.
``python -m launch.slurm outcome --run-dir DIR``: the lines the quick start ends with (``launch/outcome.py``).

``slurm/launch.sh`` calls this once per allocation, on the batch host (the first node). It reads
the launcher's knobs (environment variables, documented at the top of ``slurm/launch.sh``) and
the allocation (``SLURM_JOB_NODELIST``, ``SLURMD_NODENAME``), lays the roles out on the nodes,
and asks ``scontrol`` for the first trainer node's address (emulated or DNS-less nodes share a
hostname or do not resolve, so the node name alone is not enough). It converts an HF
``MODEL_PATH`` once into a cache when ``CONVERT=1``, then composes and resolves the run config the
way ``launch.train`` does (its ``prepare``: warm-started policy, ports; its ``save_run_config``),
so every job step reads the same ``run_config.yaml``. Last it writes FILE, a shell fragment the
launcher sources: the nodes, tasks, CPUs and GPUs of each job step. A bad knob stops the job here,
before any step starts, with one line naming it (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from launch.slurm_layout import Knobs, Layout, plan_layout
from megatron_darl import timeline
from megatron_darl.checkpoint import CONVERT_TIMEOUT_S
from megatron_darl.exit_codes import ExitCode

# Overrides ``cluster_overrides`` derives from the layout and knobs; a user override of one of
# these would contradict the job steps, so it is refused and the knob named instead.
RESERVED = {
    "cluster.trainer_ranks": "TRAINER_NODES / GPUS_PER_NODE", "cluster.rollout_workers": "ROLLOUT_NODES",
    "cluster.master_addr": "(the first trainer node)", "transport.control.host": "(the first trainer node)",
    "cluster.master_port": "TRAINER_PORT", "transport.control.port": "STORE_PORT",
    "cluster.threads_per_process": "THREADS", "loop.run_dir": "OUTPUT_DIR", "loop.resume": "RESUME",
    "parallel.tp": "TP", "parallel.pp": "PP", "loop.stop_grace_s": "(the cluster's KillWait)",
}
REPO = Path(__file__).resolve().parents[1]
JOB_PORT_BASE, JOB_PORT_SLOTS = 20000, 5000  # derived ports: 20000..29999, below the ephemeral range


def job_ports(job_id: str) -> tuple[int, int]:
    """(trainer rendezvous port, control-store port) of a Slurm job, derived from its id.

    Why not a free port: ``prepare`` runs on the batch host, where a free port says nothing about
    the first trainer node; two jobs on one node get different ports unless their ids are equal
    modulo 5000, and a requeued job keeps its ports. ``TRAINER_PORT``/``STORE_PORT`` override.
    """
    digits = re.sub(r"\D", "", job_id)
    slot = int(digits) % JOB_PORT_SLOTS if digits else 0
    return JOB_PORT_BASE + 2 * slot, JOB_PORT_BASE + 2 * slot + 1


def expand_nodelist(nodelist: str) -> list[str]:
    """Node names of a Slurm node list (``node[1-3],gpu7``), through ``scontrol show hostnames``."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.split():
        raise ValueError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()


def node_addr(name: str) -> str:
    """The node's ``NodeAddr`` from ``scontrol show node`` (falls back to its name)."""
    try:
        out = subprocess.run(["scontrol", "show", "node", name, "-o"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return name
    for field in out.stdout.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1] or name
    return name


def _tree_key(src: Path, *extra: object) -> str:
    """Hash of a directory's file names, sizes and mtimes plus ``extra`` (no content read)."""
    import hashlib

    h = hashlib.sha256(str(src.resolve()).encode())
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        st = path.stat()
        h.update(f"{path.relative_to(src)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps([str(e) for e in extra]).encode())
    return h.hexdigest()[:16]


def cached_conversion(src: Path, tp: int, pp: int, dtype: str, cache_root: Path, log=print) -> Path:
    """``src`` (HF dir) converted to a Megatron checkpoint at ``tp`` x ``pp``, once per key.

    The key covers the source directory (path, file sizes and mtimes), TP, PP and dtype; the
    converter stages into a temporary sibling renamed into place on success, so an interrupted
    or concurrent conversion never leaves a half-written cache entry.
    """
    final = cache_root / f"{src.name}-tp{tp}pp{pp}-{dtype}-{_tree_key(src, tp, pp, dtype)}"
    if final.is_dir():
        log(f"[slurm] reusing converted checkpoint {final}")
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".{final.name}.{os.getpid()}.tmp"
    log(f"[slurm] converting {src} to a Megatron checkpoint (tp={tp}, pp={pp}, {dtype}) into {final}")
    argv = [sys.executable, str(REPO / "tools" / "convert_hf_to_megatron.py"), "--hf-dir", str(src),
            "--out-dir", str(tmp), "--tp", str(tp), "--pp", str(pp), "--dtype", dtype, "--no-progress"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"CONVERT=1: converting MODEL_PATH={src} did not end within {CONVERT_TIMEOUT_S:.0f} s "
                         "(a stalled filesystem?)") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"CONVERT=1: converting MODEL_PATH={src} failed: {last}")
    try:
        tmp.rename(final)
    except OSError:  # another job finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def check_user_overrides(overrides: Sequence[str]) -> None:
    """Refuse overrides of the keys the launcher owns (``RESERVED``), naming the knob to use."""
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in RESERVED:
            raise ValueError(f"override {item!r}: {key} is set by the Slurm launcher; use {RESERVED[key]}")


def _q(value: object) -> str:
    """A Hydra override value quoted as a string (paths may hold ``,``, ``=`` or spaces)."""
    # Hydra escapes only backslashes before a quote or the end, and quotes.
    body = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), str(value))
    return f"'{body}'"


def _groups(overrides: Sequence[str]) -> set[str]:
    """Config groups the user selected on the command line (``model=...`` etc.)."""
    from launch.config import canonical_override

    keys = (canonical_override(o).split("=", 1)[0] for o in overrides if "=" in o)
    return {k for k in keys if "." not in k}


def kill_wait_s() -> int | None:
    """The cluster's ``KillWait`` (seconds from scancel's SIGTERM to SIGKILL) from ``scontrol show
    config``, None when it cannot be read."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^KillWait\s*=\s*(\d+)", out.stdout, re.MULTILINE)
    return int(found.group(1)) if found else None


def cluster_overrides(knobs: Knobs, layout: Layout, job_id: str) -> list[str]:
    """The one translation of the Slurm split into the run config: the allocation's layout and
    the ``TRAINER_*``/``ROLLOUT_*``, ``TP``/``PP``, port and ``OUTPUT_DIR`` knobs as ``cluster.*``
    (and the keys that must agree with it). They come after the user's overrides; those of
    ``RESERVED`` the user may not give at all."""
    addr = node_addr(layout.trainer_nodes[0])
    master_port, control_port = job_ports(job_id)
    return [
        f"cluster.trainer_ranks={layout.trainer_ranks}", f"cluster.rollout_workers={layout.workers}",
        f"cluster.master_addr={_q(addr)}", f"transport.control.host={_q(addr)}",
        f"cluster.master_port={knobs.master_port or master_port}",
        f"transport.control.port={knobs.control_port or control_port}",
        f"cluster.threads_per_process={layout.threads}", f"loop.run_dir={_q(knobs.output_dir)}",
        f"loop.resume={str(knobs.resume).lower()}", f"parallel.tp={knobs.tp}", f"parallel.pp={knobs.pp}",
        f"loop.stop_grace_s={kill_wait_s() or 'null'}",
    ]


def compose_overrides(knobs: Knobs, layout: Layout, user: Sequence[str], env: Mapping[str, str],
                      init_checkpoint: str = "") -> list[str]:
    """Hydra overrides of this job: knob presets, then the user's, then ``cluster_overrides``."""
    mine = _groups(user)
    out = []
    if knobs.model != "tiny" and "model" not in mine:
        out.append(f"model={knobs.model}")
    for group, value in (("algorithm", knobs.algorithm), ("data", knobs.data),
                         ("rollout", knobs.rollout), ("trainer", knobs.trainer)):
        if value and group not in mine:
            out.append(f"{group}={value}")
    if knobs.model_path:
        out.append(f"model.path={_q(knobs.model_path)}")
    if knobs.data_path:
        out.append(f"data.path={_q(knobs.data_path)}")
    if init_checkpoint:
        out.append(f"trainer.init_checkpoint={_q(init_checkpoint)}")
    out.append(f"engine.tensor_parallel_size={knobs.rollout_tp}")
    out += list(user)
    out += cluster_overrides(knobs, layout, env.get("SLURM_JOB_ID", ""))
    # Tags copied to summary.json (tools/scaling_report.py reads "nodes"); their names are record fields.
    tags = {"slurm_job_id": env.get("SLURM_JOB_ID", ""), "nodes": len(layout.nodes),
            "train_nodes": len(layout.trainer_nodes), "rollout_nodes": layout.rollout_node_count,
            "gpus_per_node": knobs.gpus_per_node}
    out += [f"++loop.extra.{k}={v}" for k, v in tags.items() if v != ""]
    return out


def write_plan(path: Path, values: Mapping[str, object]) -> Path:
    """A shell fragment: ``NAME=value`` lines, lists as bash arrays, all quoted."""
    lines = ["# written by python -m launch.slurm prepare; sourced by slurm/launch.sh"]
    for key, value in values.items():
        if isinstance(value, (list, tuple)):
            lines.append(f"{key}=({' '.join(shlex.quote(str(v)) for v in value)})")
        else:
            lines.append(f"{key}={shlex.quote(str(value))}")
    from launch.config import write_private

    return write_private(path, "\n".join(lines) + "\n")  # it names the control store's port


def prepare_job(env: Mapping[str, str], user: Sequence[str], plan_path: Path, log=print) -> dict:
    """Knobs -> layout -> (conversion) -> resolved run_config.yaml -> the launcher's plan file."""
    timeline.note("main_start")  # the launcher's imports are done (the launch timeline's phases)
    knobs = Knobs.from_env(env)
    check_user_overrides(user)
    if knobs.model != "tiny" and not knobs.model_path and not any(o.startswith("model.path=") for o in user):
        raise ValueError(f"MODEL={knobs.model} needs MODEL_PATH=<Hugging Face checkpoint directory> "
                         "(weights, config.json, tokenizer); MODEL=tiny runs the embedded tiny policy")
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", ""))
    layout = plan_layout(knobs, nodes, batch_host=env.get("SLURMD_NODENAME", ""),
                         cpus_on_node=int(env.get("SLURM_CPUS_ON_NODE") or 0))
    init_ckpt = ""
    if knobs.convert and knobs.model_path:
        init_ckpt = str(cached_conversion(Path(knobs.model_path), knobs.tp, knobs.pp, knobs.convert_dtype,
                                          Path(knobs.convert_cache), log=log))
    from launch.config import load_run_config, write_private
    from launch.preflight import max_positions, preflight
    from launch.run_dir import check_changes, commit_config, inspect_run_dir
    from launch.run_lock import LOCK_FD_ENV, RunLock
    from launch.train import prepare
    from launch.validate import check_inputs

    cfg = load_run_config(compose_overrides(knobs, layout, user, env, init_ckpt))
    timeline.note("config_loaded")
    preflight(cfg)
    run_dir = Path(cfg.loop.run_dir)
    # slurm/launch.sh holds the lock file open for the job (LOCK_FD_ENV); locked here, it stays
    # locked until the batch script ends. Without it (a direct call) the lock is only a check.
    lock = RunLock.acquire(run_dir, env, say=log, name="OUTPUT_DIR")
    try:
        state = inspect_run_dir(cfg, say=log, knobs=("OUTPUT_DIR", "set RESUME=1"))
        cfg = prepare(cfg, log_fn=log)
        check_changes(cfg, state, say=log)
        check_inputs(cfg, max_positions(cfg), say=log)
        config_path = commit_config(cfg, state, say=log)
        timeline.note("inputs_checked")
        timeline.begin(run_dir)  # this job's launch timeline (megatron_darl/timeline.py)
    except BaseException:
        lock.release()  # the job ends here
        raise
    if LOCK_FD_ENV not in env:
        lock.release()
    start = state.start_step
    plan = {
        "RUN_DIR": run_dir, "RUN_CONFIG": config_path, "STEPS": cfg.loop.steps, "START_STEP": start,
        "FINISHED": int(start >= cfg.loop.steps > 0),
        "MASTER_ADDR": cfg.cluster.master_addr, "MASTER_PORT": cfg.cluster.master_port,
        "CONTROL_ADDR": cfg.transport.control.host, "CONTROL_PORT": cfg.transport.control.port,
        "KILL_WAIT": "?" if cfg.loop.stop_grace_s is None else f"{cfg.loop.stop_grace_s:g}",
        **layout.shell_values(),
    }
    write_plan(plan_path, plan)
    write_private(run_dir / "slurm_layout.json", json.dumps(
        {"job_id": env.get("SLURM_JOB_ID", ""), **dataclasses.asdict(layout)}, indent=2) + "\n")
    return plan


def latest_step(run_dir: str | Path) -> int:
    """The step of ``run_dir``'s newest complete checkpoint, 0 when it holds none: the same
    answer as the launcher's and the trainer's (``megatron_darl.checkpoint.resume_points``)."""
    from megatron_darl.checkpoint.resume_points import checkpoint_step, latest_checkpoint  # torch: not for --help

    found = latest_checkpoint(run_dir)
    return checkpoint_step(found) if found is not None else 0


def trained_steps(run_dir: str | Path) -> int:
    """How many steps ``run_dir``'s ``summary.json`` says were trained, across restarts (0 when it
    has none). A run with ``loop.save_at_end=false`` finishes past its newest checkpoint, so the
    launcher asks this, not ``latest_step``, whether the job is done."""
    path = Path(run_dir) / "summary.json"
    try:
        return int(json.loads(path.read_text()).get("steps", 0))
    except FileNotFoundError:
        return 0
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: not a run summary ({err})") from err


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="lay out the job, write run_config.yaml and the plan")
    prep.add_argument("--plan", required=True, help="shell fragment to write (sourced by launch.sh)")
    latest = sub.add_parser("latest-step", help="print the step of the run dir's newest complete checkpoint (0: none)")
    latest.add_argument("--run-dir", required=True, help="the job's run dir (OUTPUT_DIR)")
    trained = sub.add_parser("trained-steps", help="print how many steps the run dir's summary.json counts (0: none)")
    trained.add_argument("--run-dir", required=True, help="the job's run dir (OUTPUT_DIR)")
    end = sub.add_parser("outcome", help="print the lines the quick start ends with, for the run dir")
    end.add_argument("--run-dir", required=True, help="the job's run dir (OUTPUT_DIR)")
    args, overrides = parser.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    if args.command == "latest-step":
        print(latest_step(args.run_dir))
        return 0
    if args.command == "trained-steps":
        try:
            print(trained_steps(args.run_dir))
        except ValueError as err:  # the job's end then reads the checkpoints alone
            print(f"launch.slurm: {err}", file=sys.stderr)
            print(0)
        return 0
    if args.command == "outcome":
        from launch.outcome import outcome

        print(outcome(Path(args.run_dir)))
        return 0

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        plan = prepare_job(os.environ, overrides, Path(args.plan), log=log)
    except ImportError as err:
        print(f"launch.slurm: error: {err} in {sys.executable}: activate the venv with megatron_darl "
              "before sbatch, or set DARL_PYTHON", file=sys.stderr)
        return ExitCode.USAGE
    except (ValueError, FileNotFoundError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"launch.slurm: error: {first}", file=sys.stderr)
        return ExitCode.USAGE
    except Exception as err:  # noqa: BLE001 (Hydra/OmegaConf: a bad override, one line)
        if type(err).__module__.split(".")[0] not in ("hydra", "omegaconf"):
            raise
        first = str(err).strip().splitlines()[0]
        print(f"launch.slurm: error: {first} (see python -m launch.train --help)", file=sys.stderr)
        return ExitCode.USAGE
    log(f"[slurm] run dir {plan['RUN_DIR']}: trainer {plan['TRAINER_RANKS']} rank(s) on "
        f"{plan['TRAINER_NODELIST']}, {len(plan['ROLLOUT_WORKER_NODES'])} rollout worker(s) on "
        f"{','.join(dict.fromkeys(plan['ROLLOUT_WORKER_NODES']))}; store {plan['CONTROL_ADDR']}:{plan['CONTROL_PORT']}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
