"""Benchmark ``loop_profile``: where a step of the full async loop goes at a real model size.

Runs the real main job (``python -m launch.train``: Megatron trainer and ``hf`` rollout worker as
separate processes) with a randomly initialised Qwen3 of a real shape (default 1.7B, bf16),
D-ARL, ``--groups`` x ``--group-size`` samples per step and ``--new-tokens`` new tokens (a random
policy rarely stops early, so responses run to the limit), on one GPU shared by trainer and
worker (``gpu1``: weights by CUDA IPC) and, with two GPUs, disaggregated (``gpu2``: NCCL), or at
the trainer:rollout GPU counts of ``--splits 1:1,2:2`` (``cluster=gpu4`` with
``cluster.trainer_gpus=T cluster.rollout_gpus=R``; the record names T and R). A random policy earns
no reward, so every group would be degenerate and dropped: the runs set
``replay.drop_degenerate=false`` so that the log-prob pass and the train step do their full work.

From the run's own ``metrics.jsonl`` (steps after the first ``--skip`` , which compile and warm
up), per step in seconds: ``generation`` (engine time per worker, mean over workers, and each
worker's in ``generation_per_worker``; it overlaps the trainer's work in the async loop),
``receive_wait`` (trainer idle until the step's groups arrived), ``logprob`` (candidate log-prob
pass), ``plan`` (score, select), ``backfill``, ``train`` (the optimizer steps), ``publish`` (what
the trainer spends publishing: export and staging, or all of the sync when blocking), and the
weight sync itself (off the critical path when it runs in the background): ``weight_sync`` in
all, of which ``weight_sync_wait`` for the workers' safe points, and ``weight_sync_transfer`` the
sending of one round (a worker's share: broadcast and load; ``weight_sync_rounds`` per sync); and
the workers' own ``worker_sync`` (pause, receive, load) and idle time with an empty engine
(``worker_idle_gate``: the staleness bound refused a batch; ``worker_idle_weights``: no valid
weights); each as a fraction of the step. ``engine_batch_groups`` is the
groups per engine call. ``--bound`` also runs ``benchmarks/weight_sync.py`` from GPU 0 to R
workers in the same call: ``bound_seconds`` (one NCCL broadcast of the same bytes) and
``transfer_to_bound`` = weight_sync_transfer / bound_seconds.

    python benchmarks/loop_profile.py                       # 1.7B, gpu1 (+ gpu2 with 2 GPUs)
    python benchmarks/loop_profile.py --splits 1:1,2:2 --bound   # 4 GPUs of one host
    python benchmarks/loop_profile.py --model tiny --layouts cpu --steps 3   # CPU smoke check
    python benchmarks/loop_profile.py --model default --variant darl,decoupled --steps 20 --skip 3

``--variant`` takes a comma list: each variant runs at each layout, one after the other in the same
call, and with ``decoupled`` among them every row gets ``step_to_decoupled`` (its step seconds over
decoupled's at the same layout) and ``per_sample_to_decoupled`` (the same per trained sample: a
variant that fills its quota from replay trains more samples per step than one that trains each
group once). ``--model default`` runs the embedded default exactly as the quick start does (the
warm-started tiny policy, its task, batch and trainer; only ``--steps`` and the variant change).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.async_speedup import cluster_overrides, parse_splits  # noqa: E402
from benchmarks.record import print_table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PARTS = ("generation_seconds", "receive_wait_seconds", "logprob_seconds", "plan_seconds",
         "backfill_seconds", "train_seconds", "publish_seconds", "weight_sync_seconds",
         "weight_sync_wait_seconds", "weight_sync_transfer_seconds", "worker_sync_seconds",
         "worker_idle_gate_seconds", "worker_idle_weights_seconds")
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True}


def build_policy(model: str, out: Path) -> Path:
    """A random-init HF checkpoint of ``configs/model/<model>.yaml`` (bf16) with the built-in
    task's tokenizer (the warm start's); ids past its vocabulary decode to nothing."""
    import torch
    import transformers
    import yaml

    from megatron_darl.loop.warmstart import WarmStartConfig, ensure_warm_policy

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
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def default_batch() -> dict:
    """Groups, group size and new tokens of the embedded default (what ``--model default`` runs)."""
    sys.path.insert(0, str(REPO))
    from launch.config import load_run_config

    cfg = load_run_config([])
    return {"groups": cfg.algorithm.groups_per_step, "group_size": cfg.algorithm.group_size,
            "new_tokens": cfg.sampling.max_new_tokens}


def split_counts(layout: str) -> tuple[int, int]:
    """(trainer GPUs, rollout GPUs) of a layout: ``t<T>r<R>``, ``gpu1`` (1, 1 shared), ``gpu2``."""
    if layout.startswith("t") and "r" in layout:
        t, r = layout[1:].split("r")
        return int(t), int(r)
    return {"gpu1": (1, 1), "gpu2": (1, 1)}.get(layout, (0, 0))


def run_layout(layout: str, policy: Path | None, a: argparse.Namespace, run_dir: Path,
               variant: str) -> list[dict]:
    """The main job at ``layout`` with ``variant``; its metrics rows. ``policy`` None: the
    embedded default (its model, task, batch and trainer as they are)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    common = [f"algorithm={variant}", f"loop.steps={a.steps}", f"loop.run_dir={run_dir}",
              "loop.progress_bar=false", "loop.plot=false", "loop.tensorboard=false",
              "transport.control.port=0", "cluster.master_port=0"]
    if policy is None:
        cmd = [sys.executable, "-m", "launch.train", *common, *a.overrides]
    else:
        trainer = "cpu_tiny" if layout == "cpu" else "default"
        # one 80 GB GPU holds the 1.7B trainer (fp32 Adam state) and the engine only with smaller
        # micro-batches (the logits of 16k tokens alone are 5 GB in bf16)
        budget = ["trainer.micro_batch.token_budget=8192"] if layout == "gpu1" else []
        cmd = [sys.executable, "-m", "launch.train", *cluster_overrides(layout, cpu=layout == "cpu"),
               f"trainer={trainer}", f"model.path={policy}", f"model.name={a.model}", *common,
               f"algorithm.groups_per_step={a.groups}", f"algorithm.group_size={a.group_size}",
               f"worker.groups_per_batch={a.groups}", f"sampling.max_new_tokens={a.new_tokens}",
               "replay.drop_degenerate=false", *budget, *a.overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def profile(rows: list[dict], skip: int = 1) -> dict:
    """Mean seconds per step of each part over the steps after the first ``skip``, and their fractions."""
    steady = rows[skip:] or rows
    step = statistics.fmean(r["step_seconds"] for r in steady)
    out = {"steps_measured": len(steady), "step_seconds": step,
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
                  "backfill_snapshot"):  # per step: what the trainer's work scales with
        out[count] = statistics.fmean(float(r.get(count) or 0.0) for r in steady)
    out["seconds_per_trained_sample"] = step / max(out["samples_selected"], 1e-9)
    calls = [float(r["engine_batch_groups"]) for r in steady if r.get("engine_batch_groups")]
    out["engine_batch_groups"] = statistics.fmean(calls) if calls else 0.0  # steps where a call ended
    return out


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_1.7b", help="configs/model/<name>.yaml, or tiny")
    p.add_argument("--layouts", default="", help="comma list of cluster presets (default gpu1[,gpu2])")
    p.add_argument("--splits", default="", help="comma list of trainer:rollout GPU counts, e.g. 1:1,2:2")
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the means (warm-up)")
    p.add_argument("--bound", action="store_true", help="also measure the broadcast bound per rollout count")
    p.add_argument("--variant", default="darl")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="runs per variant and layout (steady steps pooled)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/darl_loop_profile"))
    p.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = p.parse_args()
    import torch

    layouts = [x for x in a.layouts.split(",") if x] + parse_splits(a.splits)
    if a.model == "default":
        layouts = ["default"]
    elif not layouts:
        layouts = (["gpu1"] + (["gpu2"] if torch.cuda.device_count() >= 2 else [])
                   if torch.cuda.is_available() else ["cpu"])
    policy = None if a.model == "default" else build_policy(a.model, a.work_dir / "policy")
    engine = next((o.split("=", 1)[1] for o in a.overrides if o.startswith("engine.backend=")), "hf")
    bounds: dict[int, dict] = {}
    rows_out, records = [], []
    variants = [v for v in a.variant.split(",") if v]
    steady: dict[tuple[str, str], list[dict]] = {}
    seconds: dict[tuple[str, str], float] = {}
    for rep in range(a.repeats):  # --repeats: the variants' runs interleave on a shared machine
        for key in ((lay, v) for lay in layouts for v in variants):
            start = time.monotonic()
            rows = run_layout(key[0], policy, a, a.work_dir / f"{key[0]}_{key[1]}", key[1])
            steady.setdefault(key, []).extend(rows if rep == 0 else rows[a.skip:])
            seconds[key] = seconds.get(key, 0.0) + time.monotonic() - start
    for layout, variant in steady:
        metrics = profile(steady[(layout, variant)], a.skip)
        metrics["runs"] = a.repeats
        metrics["launch_seconds"] = seconds[(layout, variant)] / a.repeats
        trainer_gpus, rollout_gpus = split_counts(layout)
        if a.bound and layout != "gpu1" and rollout_gpus:
            if rollout_gpus not in bounds:
                bounds[rollout_gpus] = weight_sync_bound(a.model, rollout_gpus, a.work_dir / "bound", a.timeout)
            metrics["bound_seconds"] = bounds[rollout_gpus]["bound_seconds"]
            metrics["sync_alone_seconds"] = bounds[rollout_gpus]["seconds"]
            metrics["transfer_to_bound"] = metrics["weight_sync_transfer_seconds"] / metrics["bound_seconds"]
        batch = ({"groups": a.groups, "group_size": a.group_size, "new_tokens": a.new_tokens}
                 if policy is not None else default_batch())  # the default's own batch
        config = {"model": a.model, "layout": layout, "variant": variant, **batch, "steps": a.steps, "engine": engine,
                  "trainer_gpus": trainer_gpus, "rollout_gpus": rollout_gpus,
                  "overrides": list(a.overrides)}
        records.append((config, metrics))
    base = {c["layout"]: m for c, m in records if c["variant"] == "decoupled"}
    for config, metrics in records:
        if config["layout"] in base:  # against decoupled at the same layout, in the same call
            ref = base[config["layout"]]
            metrics["step_to_decoupled"] = metrics["step_seconds"] / ref["step_seconds"]
            metrics["per_sample_to_decoupled"] = (metrics["seconds_per_trained_sample"]
                                                  / ref["seconds_per_trained_sample"])
        print(write_result("loop_profile", config, metrics, a.out_dir))
        name = f"{config['layout']} {config['variant']}"
        rows_out.append({"layout": name, **{k: v for k, v in metrics.items()
                                            if not k.endswith("_fraction") and not isinstance(v, list)}})
        rows_out.append({"layout": f"{name} (fraction)", **{
            k.replace("_fraction", "_seconds"): v for k, v in metrics.items() if k.endswith("_fraction")}})
    print_table(rows_out)


if __name__ == "__main__":
    main()
