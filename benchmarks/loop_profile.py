"""Benchmark ``loop_profile``: where a step of the full async loop goes at a real model size.

Runs the real main job (``python -m launch.train``: Megatron trainer and rollout workers as
separate processes) with a randomly initialised Qwen3 of a real shape (default 1.7B, bf16),
D-ARL, ``--groups`` x ``--group-size`` samples per step and ``--new-tokens`` new tokens (a random
policy rarely stops early, so responses run to the limit; default 32 x 8 x 1024, the realistic
batch; ``--quick`` 8 x 8 x 512), on one GPU shared by trainer and worker (``gpu1``: weights by
CUDA IPC) and, with two GPUs, disaggregated (``gpu2``: NCCL), or at the trainer:rollout GPU counts
of ``--splits 1:1,2:2,3:1,1:3`` (``cluster=gpu4`` with ``cluster.trainer_gpus=T
cluster.rollout_gpus=R``; the record names T and R). The trainer splits a step's groups over its
DP ranks as evenly as they go (32 on 3 trainer GPUs: 11, 11 and 10). A
random policy earns no reward, so every group would be degenerate and dropped: the runs set
``replay.drop_degenerate=false`` so that the log-prob pass and the train step do their full work.

What ran is read back from the run's own ``run_config.yaml``, not guessed from the command line:
the record's config names the ``engine`` (``hf``, ``vllm``: ``rollout=vllm`` included),
its ``update_mode`` (``finish``, ``interrupt``) and the batch; before each run ``nvidia-smi`` says what
holds the GPUs (``gpu_processes_at_start``, ``gpu_memory_used_at_start_mib``: the worst of a record's
runs), so a run that started beside another's leftovers says so. From the run's ``metrics.jsonl``
(steps after the first ``--skip``, which compile and warm up), per step in seconds:
``generation`` (engine time per worker, mean over workers, and each worker's in
``generation_per_worker``; it overlaps the trainer's work in the async loop), ``receive_wait``
(trainer idle until the step's groups arrived), ``logprob`` (candidate log-prob pass), ``plan``
(score, select), ``backfill``, ``train`` (the optimizer steps), ``publish`` (what the trainer
spends publishing: export and staging, or all of the sync when blocking), and the weight sync
itself (off the critical path when it runs in the background): ``weight_sync`` in all, of which
``weight_sync_wait`` for the workers' safe points, and ``weight_sync_transfer`` the sending of one
round (a worker's share: broadcast and load; ``weight_sync_rounds`` per sync); and the workers'
own ``worker_sync`` (pause, receive, load) and idle time with an empty engine
(``worker_idle_gate``: the staleness bound refused a batch; ``worker_idle_weights``: no valid
weights), and the worker loop's own time outside the engine poll (``worker_flush``: sending groups,
back-pressure included; ``worker_admit``: admitting new ones; ``worker_collect``: decoding finished
ones into groups); each as a fraction of the step. ``engine_batch_groups`` is the groups per engine call.
``--bound`` also runs ``benchmarks/weight_sync.py`` from GPU 0 to R workers in the same call:
``bound_seconds`` (one NCCL broadcast of the same bytes) and ``transfer_to_bound`` =
weight_sync_transfer / bound_seconds.

Start-up: ``launch_seconds`` is the wall time of the whole ``launch.train`` process (start-up,
every step, the final checkpoint and the teardown; mean over ``--repeats``), not the time to the
first step. Where the trainer wrote ``<run_dir>/launch_timeline.json`` (``{"t0", "phases": {...}}``)
every phase is copied into the metrics, named ``launch_<phase>`` (``launch_to_first_step_seconds``
as it is); where the metrics rows carry the cumulative ``dynamo_compiles``,
``dynamo_compiles_after_first_step`` is its last value less its first (torch.compile frames
compiled after step 0: recompilations the steady state pays). Older runs have neither; their
records just lack these fields.

    python benchmarks/loop_profile.py                       # 1.7B, gpu1 (+ gpu2 with 2 GPUs)
    python benchmarks/loop_profile.py --splits 1:1,2:2 --bound   # 4 GPUs of one host
    python benchmarks/loop_profile.py --model tiny --layouts cpu --steps 3 --quick  # CPU smoke check
    python benchmarks/loop_profile.py --model default --variant darl,decoupled --steps 20 --skip 3

Bookkeeping: the layouts run one after the other, each variant (``--variant`` takes a comma list)
``--repeats`` times at a layout (the variants' runs interleave, so a shared machine's noise falls
on both) before the next layout. A record is written as soon as the last run of its (layout,
variant) ended, and that run dir's ``checkpoints/`` is deleted after every run (the runs keep one
final checkpoint, ``loop.keep_checkpoints=1``, and none on the way, ``loop.checkpoint_interval=0``;
at 1.7B it is ~32 GiB with D-ARL's snapshots, and the next run needs the disk). A run that fails
(exit status, timeout, no metrics) is reported at once, its layout and variant get no record, and
the later runs go on; the script exits 1 at the end, naming each failed run with the tail of its
output. With ``decoupled`` among the variants, every record at a layout where decoupled's record
exists gets ``step_to_decoupled`` (its step seconds over decoupled's) and
``per_sample_to_decoupled`` (the same per trained sample: a variant that fills its quota from
replay trains more samples per step than one that trains each group once): a record written
before decoupled's is rewritten in place (``amend_result``) once decoupled's is there.
``--model default`` runs the embedded default exactly as the quick start does (the warm-started
tiny policy, its task, batch and trainer; only ``--steps`` and the variant change).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.async_speedup import cluster_overrides, parse_splits  # noqa: E402
from benchmarks.record import (amend_result, gpus_in_use, print_table, run_config_facts,  # noqa: E402
                               write_result)
from megatron_darl import timeline  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PARTS = ("generation_seconds", "receive_wait_seconds", "prefetch_seconds", "logprob_seconds", "plan_seconds",
         "backfill_seconds", "train_seconds", "train_forward_backward_seconds", "train_grad_reduce_seconds",
         "train_optimizer_seconds", "publish_seconds", "weight_sync_seconds",
         "weight_sync_wait_seconds", "weight_sync_transfer_seconds", "worker_sync_seconds",
         "worker_idle_gate_seconds", "worker_idle_weights_seconds", "worker_flush_seconds",
         "worker_admit_seconds", "worker_collect_seconds", "gc_seconds")
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}
REALISTIC = {"groups": 32, "group_size": 8, "new_tokens": 1024}  # the scaling study's batch
QUICK = {"groups": 8, "group_size": 8, "new_tokens": 512}  # --quick: the batch of the first records
# measure the loop, not the checkpoint: one final checkpoint kept, none on the way; nor the
# held-out points (the one at version 0 comes before the first step, as verl's val_before_train:
# 7-58 s of a 1.7B launch on an H200 by engine and split). An override puts either back.
MEASURE = ("loop.keep_checkpoints=1", "loop.checkpoint_interval=0", "loop.save_at_end=false",
           "eval.benchmarks=[]")
TAIL_CHARS = 3000  # of a failed run's stdout and of its stderr, in the report


class RunFailed(RuntimeError):
    """A run that did not finish; the message names its layout and variant and ends with its output."""


@dataclass
class RunResult:
    """What one finished run left in its run dir, read before the dir is reused."""

    rows: list[dict]  # metrics.jsonl, one row per step
    facts: dict[str, Any]  # run_config.yaml's engine, update_mode and batch (record.RUN_FACTS)
    timeline: dict[str, float]  # launch_timeline.json's phases ({} for runs without one)
    wall_seconds: float  # launch.train's wall time, start to exit
    gpus_at_start: dict[str, float] = field(default_factory=dict)  # record.gpus_in_use() ({}: no GPU)


@dataclass
class Plan:
    """What one invocation measures and where it writes."""

    layouts: list[str]  # cluster labels: cpu, gpu1, gpu2, default, t<T>r<R>
    variants: list[str]  # algorithm presets, run at every layout
    base: dict[str, Any]  # config every record shares: model, requested batch, steps, overrides
    work_dir: Path  # run dirs, <layout>_<variant>
    out_dir: Optional[Path] = None  # records (None: benchmarks/results)
    repeats: int = 1  # runs per (layout, variant), steady steps pooled
    skip: int = 1  # warm-up steps of each run left out of the means


def build_policy(model: str, out: Path) -> Path:
    """A random-init HF checkpoint of ``configs/model/<model>.yaml`` (bf16) with the built-in
    task's tokenizer (the warm start's); ids past its vocabulary decode to nothing."""
    import torch
    import transformers
    import yaml

    from launch.warmstart import ensure_warm_policy
    from megatron_darl.models.config import WarmStartConfig

    if model == "tiny":
        fields = dict(TINY)
    else:
        fields = dict(yaml.safe_load((REPO / "configs" / "model" / f"{model}.yaml").read_text())["hf_config"])
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
    tokenizer_dir = ensure_warm_policy(WarmStartConfig(), log=lambda *_: None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    fields.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    cfg = transformers.Qwen3Config(**fields)
    weights = (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists()
    if weights and (out / "config.json").exists():
        saved = json.loads((out / "config.json").read_text())
        if all(saved.get(k) == v for k, v in fields.items()):
            return out  # built by an earlier invocation in the same work dir (a device call: 20-30 s)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del hf
    torch.cuda.empty_cache()  # the runs' trainer starts on GPU 0: give it this process's cache (no-op on CPU)
    return out


def split_counts(layout: str) -> tuple[int, int]:
    """(trainer GPUs, rollout GPUs) of a layout: ``t<T>r<R>``, ``gpu1`` (1, 1 shared), ``gpu2``."""
    if layout.startswith("t") and "r" in layout:
        t, r = layout[1:].split("r")
        return int(t), int(r)
    return {"gpu1": (1, 1), "gpu2": (1, 1)}.get(layout, (0, 0))


def launch_command(layout: str, variant: str, policy: Path | None, a: argparse.Namespace,
                   run_dir: Path) -> list[str]:
    """``launch.train`` at ``layout`` with ``variant``; ``policy`` None: the embedded default (its
    model, task, batch and trainer as they are)."""
    common = [f"algorithm={variant}", f"loop.steps={a.steps}", f"loop.run_dir={run_dir}",
              "loop.progress_bar=false", "loop.plot=false", "loop.tensorboard=false", *MEASURE,
              "transport.control.port=0", "cluster.master_port=0"]
    if policy is None:
        return [sys.executable, "-m", "launch.train", *common, *a.overrides]
    groups = a.groups
    per_worker = -(-groups // max(1, split_counts(layout)[1]))  # a batch engine takes its share, not all
    return [sys.executable, "-m", "launch.train", *cluster_overrides(layout, cpu=layout == "cpu"),
            *trainer_overrides(layout, a.new_tokens), f"model.path={policy}", f"model.name={a.model}",
            *common, f"algorithm.groups_per_step={groups}", f"algorithm.group_size={a.group_size}",
            f"worker.groups_per_batch={per_worker}", f"sampling.max_new_tokens={a.new_tokens}",
            "replay.drop_degenerate=false", *a.overrides]


def trainer_overrides(layout: str, new_tokens: int) -> list[str]:
    """The trainer preset of ``layout`` and the micro-batch limits the batch needs there."""
    if layout == "cpu":  # the tiny CPU trainer's 1024-token sequences: room for the response and a prompt
        seq = new_tokens + 256
        return ["trainer=cpu_tiny", f"trainer.micro_batch.max_seq_len={seq}",
                f"trainer.micro_batch.token_budget={max(2048, -(-seq // 8) * 8)}"]
    # one 80 GB GPU holds the 1.7B trainer (fp32 Adam state) and the engine only with smaller
    # micro-batches (the logits of 16k tokens alone are 5 GB in bf16)
    return ["trainer=default"] + (["trainer.micro_batch.token_budget=8192"] if layout == "gpu1" else [])


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):  # TimeoutExpired keeps bytes even for a text=True run
        text = text.decode(errors="replace")
    return (text or "")[-TAIL_CHARS:]


def run_layout(layout: str, variant: str, policy: Path | None, a: argparse.Namespace,
               run_dir: Path) -> float:
    """One run in a fresh ``run_dir``; its wall seconds. ``RunFailed`` on a non-zero exit or a timeout.

    The launcher's output (trainer rank 0's log) streams to ``<run_dir>.launch_train.log`` while it
    runs, so a run killed at ``--timeout`` keeps what it logged; it moves into the run dir at exit."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    log_path = run_dir.with_name(f"{run_dir.name}.launch_train.log")
    busy = gpus_in_use()
    if busy and busy["gpu_processes_at_start"]:
        print(f"loop_profile: {busy['gpu_processes_at_start']:.0f} processes hold "
              f"{busy['gpu_memory_used_at_start_mib']:.0f} MiB of the GPUs before {layout} {variant} starts: "
              "it runs beside them", file=sys.stderr, flush=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launch_command(layout, variant, policy, a, run_dir), cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)
            raise RunFailed(f"{layout} {variant}: no exit within --timeout {a.timeout:.0f} s (its log: "
                            f"{log_path}):\n{_tail(log_path.read_text(errors='replace'))}") from None
    output = log_path.read_text(errors="replace")
    if run_dir.is_dir():
        shutil.move(log_path, run_dir / "launch_train.log")
        if busy is not None:
            (run_dir / "gpus_at_start.json").write_text(json.dumps(busy))
    if rc != 0:
        raise RunFailed(f"{layout} {variant} failed (exit {rc}):\n{_tail(output)}")
    return time.monotonic() - start


def read_run(run_dir: Path, wall_seconds: float) -> RunResult:
    """The metrics rows, resolved config facts and launch phases of a finished run dir."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (the run logged no step)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind") != "heldout"]  # training steps only (eval.* points)
    if not rows:
        raise ValueError(f"{path}: no step rows")
    busy = run_dir / "gpus_at_start.json"
    gpus = json.loads(busy.read_text()) if busy.is_file() else {}
    return RunResult(rows, run_config_facts(run_dir), timeline.saved_phases(run_dir), wall_seconds, gpus)


def profile(rows: list[dict], skip: int = 1) -> dict:
    """Mean seconds per step of each part over the steps after the first ``skip``, and their fractions."""
    steady = rows[skip:] or rows
    step = statistics.fmean(r["step_seconds"] for r in steady)
    seconds = [r["step_seconds"] for r in steady]  # the median and the worst: one slow step moves the mean
    out = {"steps_measured": len(steady), "step_seconds": step, "step_seconds_median": statistics.median(seconds),
           "step_seconds_max": max(seconds),
           "samples_per_s": statistics.fmean(r["samples_received"] for r in steady) / step,
           "trainer_tokens_per_s": statistics.fmean(r.get("trainer_tokens_per_s") or 0.0 for r in steady),
           "mfu": statistics.fmean(r.get("mfu") or 0.0 for r in steady),
           "first_step_seconds": rows[0]["step_seconds"]}
    for part in PARTS:
        mean = statistics.fmean(float(r.get(part) or 0.0) for r in steady)
        name = part.removesuffix("_seconds")
        out[f"{name}_seconds"] = mean
        out[f"{name}_fraction"] = mean / step
    workers = sorted(k for k in steady[0] if k.startswith("generation_seconds_w"))
    out["generation_per_worker"] = [statistics.fmean(float(r.get(k) or 0.0) for r in steady) for k in workers]
    out["weight_sync_rounds"] = statistics.fmean(float(r.get("weight_sync_rounds") or 0.0) for r in steady)
    for count in ("samples_selected", "candidate_groups", "groups_scored", "logprob_passes",
                  "backfill_snapshot", "prefetch_passes", "logprob_rows_computed", "logprob_rows_prefetched",
                  "logprob_rows_reused", "logprob_rows_duplicate",
                  "gc_full_collections"):  # per step: what the trainer's work scales with
        out[count] = statistics.fmean(float(r.get(count) or 0.0) for r in steady)
    needed = out["logprob_rows_reused"] + out["logprob_rows_computed"]  # rows the steps needed
    out["logprob_cache_hit_rate"] = out["logprob_rows_reused"] / needed if needed else 0.0
    out["seconds_per_trained_sample"] = step / max(out["samples_selected"], 1e-9)
    calls = [float(r["engine_batch_groups"]) for r in steady if r.get("engine_batch_groups")]
    out["engine_batch_groups"] = statistics.fmean(calls) if calls else 0.0  # steps where a call ended
    return out


def launch_metrics(run: RunResult) -> dict[str, float]:
    """The launch phases as ``launch_<phase>`` and ``dynamo_compiles_after_first_step`` (the
    cumulative counter's last value less its first, over the rows that carry it); each only where
    the run wrote it."""
    out = {k if k.startswith("launch_") else f"launch_{k}": v for k, v in run.timeline.items()}
    counts = [r["dynamo_compiles"] for r in run.rows if isinstance(r.get("dynamo_compiles"), (int, float))]
    if counts:
        out["dynamo_compiles_after_first_step"] = counts[-1] - counts[0]
    return out


def _mean_by_key(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for d in dicts for k in d)
    return {k: statistics.fmean(d[k] for d in dicts if k in d) for k in keys}


def build_record(runs: list[RunResult], skip: int, base: dict[str, Any]) -> tuple[dict, dict]:
    """(config, metrics) of one (layout, variant) from its runs: the steady steps pooled (the
    first run's warm-up counts only towards ``first_step_seconds``), the config as the runs
    resolved it."""
    rows = runs[0].rows + [r for run in runs[1:] for r in run.rows[skip:]]
    metrics = profile(rows, skip)
    metrics["runs"] = len(runs)
    metrics["launch_seconds"] = statistics.fmean(run.wall_seconds for run in runs)
    metrics.update(_mean_by_key([launch_metrics(run) for run in runs]))
    for key in dict.fromkeys(k for run in runs for k in run.gpus_at_start):  # the worst start of the runs
        metrics[key] = max(run.gpus_at_start.get(key, 0.0) for run in runs)
    config = {**base, "engine": None, "update_mode": None, **runs[0].facts}
    if base.get("groups") is not None and config["groups"] != base["groups"]:
        config["groups_requested"] = base["groups"]
    if config.get("groups") and config.get("group_size"):
        # The loop makes one step per B groups received on average (endpoints.Backlog), so its
        # sustained rate is B x G per step; ``samples_per_s`` (received in the measured steps)
        # also counts the backlog the engines built ahead during the first steps, which a short
        # run has not drained (1:1 darl, 5 steps: 307 samples a step for B x G = 256).
        metrics["sustained_samples_per_s"] = config["groups"] * config["group_size"] / metrics["step_seconds"]
    return config, metrics


def to_decoupled(metrics: dict, ref: dict) -> dict[str, float]:
    """Step seconds and seconds per trained sample over decoupled's (``ref``) at the same layout."""
    return {"step_to_decoupled": metrics["step_seconds"] / ref["step_seconds"],
            "per_sample_to_decoupled": metrics["seconds_per_trained_sample"] / ref["seconds_per_trained_sample"]}


def weight_sync_bound(model: str, workers: int, out_dir: Path, timeout: float) -> dict:
    """``benchmarks/weight_sync.py`` from GPU 0 to ``workers`` GPUs: its record's metrics."""
    shape = model.removeprefix("qwen3_")
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("weight_sync_*.json"))
    cmd = [sys.executable, str(REPO / "benchmarks" / "weight_sync.py"), "--model", shape,
           "--workers", str(workers), "--repeats", "3", "--out-dir", str(out_dir)]
    subprocess.run(cmd, cwd=REPO, check=True, timeout=timeout, capture_output=True, text=True)
    new = sorted(set(out_dir.glob("weight_sync_*.json")) - before)
    return json.loads(new[-1].read_text())["metrics"]


Written = dict[tuple[str, str], tuple[Path, dict, dict]]  # (layout, variant) -> path, config, metrics


def write_record(plan: Plan, layout: str, variant: str, runs: list[RunResult], written: Written,
                 bound: Callable[[int], dict] | None) -> None:
    """Write the record of (layout, variant); once decoupled's record at ``layout`` exists, add
    the comparisons to every record there (rewriting those written before it)."""
    trainer_gpus, rollout_gpus = split_counts(layout)
    base = {**plan.base, "layout": layout, "variant": variant, "trainer_gpus": trainer_gpus,
            "rollout_gpus": rollout_gpus}
    config, metrics = build_record(runs, plan.skip, base)
    if bound is not None and layout != "gpu1" and rollout_gpus:
        measured = bound(rollout_gpus)
        if measured:
            metrics["bound_seconds"] = measured["bound_seconds"]
            metrics["sync_alone_seconds"] = measured["seconds"]
            metrics["transfer_to_bound"] = metrics["weight_sync_transfer_seconds"] / measured["bound_seconds"]
    path = write_result("loop_profile", config, metrics, plan.out_dir)
    print(f"{layout} {variant}: {path}", flush=True)
    written[(layout, variant)] = (path, config, metrics)
    if (layout, "decoupled") in written:
        ref = written[(layout, "decoupled")][2]
        for (lay, _), (other, _, m) in written.items():
            if lay == layout and "step_to_decoupled" not in m:
                extra = to_decoupled(m, ref)
                m.update(extra)
                amend_result(other, extra)


MEASURE_ERRORS = (RunFailed, OSError, ValueError, KeyError, ZeroDivisionError)  # a run's, or its record's


def run_plan(plan: Plan, run: Callable[[str, str, Path], float],
             bound: Callable[[int], dict] | None = None) -> tuple[Written, list[str]]:
    """Every variant ``plan.repeats`` times at each layout, a layout's runs before the next's.

    ``run(layout, variant, run_dir)`` runs one job and returns its wall seconds (``RunFailed``
    when it fails). A record is written as soon as its last run ended; a failed run (or a record
    that cannot be made from it) is reported at once and the plan goes on. Returns the records
    written and one line per failure."""
    written: Written = {}
    failures: list[str] = []
    for layout in plan.layouts:
        runs: dict[str, list[RunResult]] = {v: [] for v in plan.variants}
        for rep in range(plan.repeats):
            for variant in [v for v in plan.variants if v in runs]:  # not those that failed here
                run_dir = plan.work_dir / f"{layout}_{variant}"
                try:
                    runs[variant].append(read_run(run_dir, run(layout, variant, run_dir)))
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
                    if len(runs[variant]) == plan.repeats:
                        write_record(plan, layout, variant, runs[variant], written, bound)
                except MEASURE_ERRORS as err:
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
                    failures.append(f"{layout} {variant} (run {rep + 1} of {plan.repeats}): {err}")
                    print(f"FAILED {failures[-1]}", file=sys.stderr, flush=True)
                    del runs[variant]
    return written, failures


def summary_rows(written: Written) -> list[dict]:
    """Two table rows per record: seconds per step, then each part's fraction of the step."""
    out = []
    for (layout, variant), (_, _, metrics) in written.items():
        name = f"{layout} {variant}"
        out.append({"layout": name, **{k: v for k, v in metrics.items()
                                       if not k.endswith("_fraction") and not isinstance(v, list)}})
        out.append({"layout": f"{name} (fraction)", **{
            k.replace("_fraction", "_seconds"): v for k, v in metrics.items() if k.endswith("_fraction")}})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_1.7b", help="configs/model/<name>.yaml, tiny, or default")
    p.add_argument("--layouts", default="", help="comma list of cluster presets (default gpu1[,gpu2])")
    p.add_argument("--splits", default="", help="comma list of trainer:rollout GPU counts, e.g. 1:1,2:2,3:1,1:3")
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the means (warm-up)")
    p.add_argument("--bound", action="store_true", help="also measure the broadcast bound per rollout count")
    p.add_argument("--variant", default="darl", help="comma list of algorithm presets")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="runs per variant and layout (steady steps pooled)")
    p.add_argument("--quick", action="store_true",
                   help=f"the quick check's batch, {QUICK['groups']} x {QUICK['group_size']} x {QUICK['new_tokens']}")
    p.add_argument("--groups", type=int, default=None, help=f"groups per step (default {REALISTIC['groups']})")
    p.add_argument("--group-size", type=int, default=None, help=f"samples per group (default {REALISTIC['group_size']})")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"new tokens per sample (default {REALISTIC['new_tokens']})")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per run")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/darl_loop_profile"), help="policy and run dirs")
    p.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = p.parse_args(argv)
    preset = QUICK if a.quick else REALISTIC
    for name in preset:  # a flag given wins over the preset
        if getattr(a, name) is None:
            setattr(a, name, preset[name])
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def default_layouts(a: argparse.Namespace) -> list[str]:
    """``--layouts`` and ``--splits``; else gpu1 (and gpu2 with two GPUs), or cpu without a GPU."""
    if a.model == "default":
        return ["default"]
    layouts = [x for x in a.layouts.split(",") if x] + parse_splits(a.splits)
    if layouts:
        return layouts
    import torch

    if not torch.cuda.is_available():
        return ["cpu"]
    return ["gpu1"] + (["gpu2"] if torch.cuda.device_count() >= 2 else [])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    layouts = default_layouts(a)
    policy = None if a.model == "default" else build_policy(a.model, a.work_dir / "policy")
    batch = ({"groups": None, "group_size": None, "new_tokens": None} if policy is None  # the default's own
             else {"groups": a.groups, "group_size": a.group_size, "new_tokens": a.new_tokens})
    plan = Plan(layouts=layouts, variants=[v for v in a.variant.split(",") if v], work_dir=a.work_dir,
                base={"model": a.model, **batch, "steps": a.steps, "overrides": list(a.overrides)},
                out_dir=a.out_dir, repeats=a.repeats, skip=a.skip)
    bounds: dict[int, dict] = {}
    bound_failures: list[str] = []

    def bound(workers: int) -> dict:
        if workers not in bounds:
            try:
                bounds[workers] = weight_sync_bound(a.model, workers, a.work_dir / "bound", a.timeout)
            except (subprocess.SubprocessError, OSError, ValueError, KeyError) as err:
                bound_failures.append(f"weight_sync bound to {workers} workers: {err}")
                bounds[workers] = {}
        return bounds[workers]

    written, failed = run_plan(plan, lambda lay, v, d: run_layout(lay, v, policy, a, d),
                               bound if a.bound else None)
    print_table(summary_rows(written))
    failures = failed + bound_failures
    for line in failures:
        print(f"FAILED {line}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} failed; {len(written)} records written", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
