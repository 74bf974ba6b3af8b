"""Benchmark ``async_speedup``: what disaggregated asynchronous training buys over synchronous.

Each run is the real main job (``python -m launch.train``: the Megatron trainer and a rollout
worker, ``hf`` unless overridden, as separate processes over our transport) on the built-in task,
started from the same warm-started policy. Per variant and seed it reads the run's own ``metrics.jsonl``:

- ``samples_per_s``: samples received by the trainer per second of wall time (after step 0,
  so process start-up and the first generation are not counted);
- ``samples_to_target`` / ``seconds_to_target``: samples generated (and seconds since step 0)
  until the 5-step moving mean of the reward first reaches ``--target``; missing when never
  reached. (Records before commit 51e6882's successor counted these seconds from trainer start.)

Each run's summary (and the record's config, where every run agrees) names the ``engine`` and its
``update_mode`` as the run resolved them in its own ``run_config.yaml`` (``rollout=vllm``
included), and the batch is explicit: ``--groups`` x ``--group-size`` samples of up to
``--new-tokens`` (default 16 x 8 and the task preset's 48 new tokens: the learning study's shape,
kept so that its records compare; ``--new-tokens`` past ~1000 needs
``trainer.micro_batch.max_seq_len`` raised to hold prompt and response). The runs keep one final
checkpoint (``loop.keep_checkpoints=1``, none on the way) and each run's ``checkpoints/`` is
deleted once its summary is kept, so a long plan does not fill the disk.

The baseline is ``sync`` with trainer and rollout sharing one GPU (``cluster=gpu1``); every
variant runs with the trainer on GPU 0 and the rollout worker on GPU 1 (``cluster=gpu2``), so
``speedup_vs_sync`` = samples/s of the variant on two GPUs / samples/s of sync on one GPU (mean
and standard deviation over seeds). ``--splits 2:2,4:4,6:2`` runs every variant at those
trainer:rollout GPU counts instead (``cluster.trainer_gpus``/``rollout_gpus``: trainer ranks on
the first GPUs, one rollout worker on each of the next; add ``parallel.tp=2`` and the like as
overrides); those cases
are named ``<variant>_t<T>r<R>``. Each run also reports its mean ``weight_sync_seconds`` (the
trainer's publish, export included, to every worker) after step 0. Anchors: AReaL reports up to 2.77x over synchronous
training; the D-ARL paper reports 34.7% better sample efficiency than asynchronous baselines.

    python benchmarks/async_speedup.py --out-dir OUT                     # GPU: ~57M policy
    python benchmarks/async_speedup.py --size tiny --cpu --steps 6 --seeds 0 --variants sync,darl

A full 3-seed comparison outlasts one 10-minute device call, so ``--partial FILE`` keeps every
finished run's summary (with the config it ran under) and skips it when the script is started
again; ``--budget SECONDS`` starts no new run past that point and exits with status 3 while runs
remain. The record is written once every run of the plan has a summary.
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
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, run_config_facts, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MEASURE = ("loop.keep_checkpoints=1", "loop.checkpoint_interval=0")  # one final checkpoint, none on the way
SIZES = {  # warm-started policy shapes (launch/warmstart.py TinyModelConfig)
    "tiny": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    "57m": {"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 8,
            "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64},
}


def cluster_overrides(label: str, cpu: bool) -> list[str]:
    """Hydra overrides of a plan's cluster label: ``gpu1``/``gpu2``/``cpu`` or ``t<T>r<R>``."""
    if not label.startswith("t"):
        return [f"cluster={label}"]
    trainers, workers = (int(x) for x in label[1:].split("r"))
    if cpu:
        return ["cluster=cpu", f"cluster.trainer_ranks={trainers}", f"cluster.rollout_workers={workers}"]
    return ["cluster=gpu4", f"cluster.trainer_gpus={trainers}", f"cluster.rollout_gpus={workers}"]


def parse_splits(text: str) -> list[str]:
    """``"2:2,4:4"`` -> ``["t2r2", "t4r4"]``; a malformed split is an error naming it."""
    labels = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise SystemExit(f"--splits: {item!r} is not TRAINER_GPUS:ROLLOUT_GPUS (e.g. 2:2)")
        labels.append(f"t{parts[0]}r{parts[1]}")
    return labels


def run_once(variant: str, seed: int, cluster: str, args, run_dir: Path, fresh: bool = True,
             extra: Sequence[str] = ()) -> dict:
    """One ``launch.train`` run in a fresh ``run_dir`` (``fresh=False``: the caller passes
    ``loop.resume=true`` and the run goes on from its latest checkpoint there); returns its
    per-step metrics rows. ``args.group_size`` and ``args.new_tokens`` set the batch where the
    caller has them; ``extra`` overrides go before ``args.overrides`` (which win)."""
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    shape = [f"warmstart.model.{k}={v}" for k, v in SIZES[args.size].items()]
    cmd = [sys.executable, "-m", "launch.train", f"algorithm={variant}", *cluster_overrides(cluster, args.cpu),
           f"loop.run_dir={run_dir}", f"loop.steps={args.steps}", "loop.progress_bar=false",
           "loop.plot=false", "loop.tensorboard=false", "transport.control.port=0",
           "cluster.master_port=0", f"algorithm.seed={seed}", f"sampling.seed={seed}",
           f"trainer.seed={1234 + seed}", f"warmstart.lr={args.warmstart_lr}",
           f"trainer.optimizer.lr={args.lr}", f"algorithm.groups_per_step={args.groups}",
           f"worker.groups_per_batch={args.groups}", *shape, *batch_overrides(args), *extra,
           *args.overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} seed {seed} on {cluster} failed ({proc.returncode}):\n"
                           + proc.stdout[-2000:] + proc.stderr[-2000:])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") != "heldout"]  # training steps only (eval.* points)
    return {"rows": rows, "launch_seconds": time.monotonic() - start}


def batch_overrides(args) -> list[str]:
    """Group size and new tokens of the batch, for the callers that set them (variant_study sets
    its own in its overrides)."""
    out = []
    if getattr(args, "group_size", None) is not None:
        out.append(f"algorithm.group_size={args.group_size}")
    if getattr(args, "new_tokens", None) is not None:
        out.append(f"sampling.max_new_tokens={args.new_tokens}")
    return out


def agreed(summaries: list[dict], key: str) -> Any:
    """The value of ``key`` every summary has (None where they differ or lack it: older partial files)."""
    values = {s.get(key) for s in summaries}
    return values.pop() if len(values) == 1 else None


def summarize_run(rows: list[dict], target: float) -> dict:
    """samples/s after step 0, and samples and seconds to the target (5-step moving mean)."""
    first, last = rows[0], rows[-1]
    samples = last["samples_generated"] - first["samples_generated"]
    seconds = max(last["wall_seconds"] - first["wall_seconds"], 1e-9)
    out = {"samples_per_s": samples / seconds, "reward_first": rows[0]["reward_mean"],
           "reward_last5": statistics.fmean(r["reward_mean"] for r in rows[-5:]),
           "samples_to_target": None, "seconds_to_target": None,
           "weight_sync_seconds": statistics.fmean(r.get("weight_sync_seconds") or 0.0 for r in rows[1:])
           if len(rows) > 1 else None,
           "curve": [[r["samples_generated"], r["wall_seconds"], r["reward_mean"]] for r in rows]}
    for i in range(4, len(rows)):
        if statistics.fmean(r["reward_mean"] for r in rows[i - 4: i + 1]) >= target:
            out["samples_to_target"] = rows[i]["samples_generated"]
            out["seconds_to_target"] = rows[i]["wall_seconds"] - first["wall_seconds"]
            break
    return out


def load_partial(path: Path | None, run_config: dict) -> dict[str, dict]:
    """Summaries of runs finished by an earlier invocation under the same settings."""
    if path is None or not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved.get("config") != run_config:
        raise SystemExit(f"{path}: its runs were made with {saved.get('config')}, not {run_config}; "
                         "pass another --partial file or delete this one")
    return dict(saved["runs"])


def save_partial(path: Path | None, run_config: dict, done: dict[str, dict],
                 device: str | None = None) -> None:
    """Atomically replace the partial file; ``device`` (where the runs ran) lets a record be
    written from it on another machine."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    saved = {"config": run_config, "runs": done, **({"device": device} if device else {})}
    tmp.write_text(json.dumps(saved, indent=1, sort_keys=True))
    tmp.replace(path)


def mean_std(values: list[float | None]) -> dict:
    got = [v for v in values if v is not None]
    return {"mean": statistics.fmean(got) if got else None,
            "std": statistics.stdev(got) if len(got) > 1 else 0.0 if got else None,
            "n": len(got), "of": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="sync,async,decoupled,darl")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--groups", type=int, default=16, help="groups per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per group (G)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="new tokens per sample at most (default: the task preset's, 48 for the built-in task)")
    parser.add_argument("--target", type=float, default=0.5, help="reward target (5-step mean)")
    parser.add_argument("--size", choices=sorted(SIZES), default="57m")
    parser.add_argument("--lr", type=float, default=3e-5, help="RL learning rate")
    parser.add_argument("--warmstart-lr", type=float, default=1e-3)
    parser.add_argument("--splits", default="",
                        help="trainer:rollout GPU counts, e.g. 2:2,4:4,6:2 (default: 1:1 as cluster=gpu2)")
    parser.add_argument("--cpu", action="store_true", help="CPU smoke check (cluster=cpu for every run)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    parser.add_argument("--run-root", type=Path, default=Path("/tmp/async_speedup_runs"))
    parser.add_argument("--partial", type=Path, default=None,
                        help="JSON file of finished runs: read, skipped, and extended after each run")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which no new run starts (exit 3 while runs remain)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    variants, seeds = args.variants.split(","), [int(s) for s in args.seeds.split(",")]
    plan = [("sync", s, "cpu" if args.cpu else "gpu1") for s in seeds]
    clusters = parse_splits(args.splits) or ["cpu" if args.cpu else "gpu2"]
    plan += [(v, s, c) for c in clusters for v in variants for s in seeds]
    run_config = {"target": args.target, "steps": args.steps, "groups": args.groups,
                  "group_size": args.group_size, "new_tokens": args.new_tokens,
                  "size": args.size, "lr": args.lr,
                  "warmstart_lr": args.warmstart_lr, "overrides": args.overrides}
    done = load_partial(args.partial, run_config)
    started, slowest = time.monotonic(), 0.0
    runs: dict[tuple[str, str], list[dict]] = {}
    for variant, seed, cluster in plan:
        key = f"{variant}_{cluster}_s{seed}"
        if key not in done:
            if args.budget is not None and time.monotonic() - started + slowest > args.budget:
                left = [f"{v}_{c}_s{s}" for v, s, c in plan if f"{v}_{c}_s{s}" not in done]
                print(f"budget of {args.budget:.0f} s reached; {len(left)} runs left: {', '.join(left)}")
                sys.exit(3)
            run_dir = args.run_root / key
            result = run_once(variant, seed, cluster, args, run_dir, extra=MEASURE)
            slowest = max(slowest, result["launch_seconds"])
            facts = run_config_facts(run_dir)
            done[key] = summarize_run(result["rows"], args.target) | {
                "seed": seed, "launch_seconds": result["launch_seconds"],
                **{k: facts.get(k) for k in ("engine", "update_mode", "new_tokens")}}
            save_partial(args.partial, run_config, done)
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        summary = done[key]
        runs.setdefault((variant, cluster), []).append(summary)
        print(f"{variant:10s} {cluster} seed {seed}: {summary['samples_per_s']:.1f} samples/s, reward "
              f"{summary['reward_first']:.3f} -> {summary['reward_last5']:.3f}, to target "
              f"{summary['samples_to_target']} samples ({summary['launch_seconds']:.0f} s launch)", flush=True)
    base_cluster = "cpu" if args.cpu else "gpu1"
    base = statistics.fmean(r["samples_per_s"] for r in runs[("sync", base_cluster)])
    metrics, table = {}, []
    for (variant, cluster), rs in runs.items():
        name = f"{variant}_{cluster}"
        speed = mean_std([r["samples_per_s"] / base for r in rs])
        to_target = mean_std([r["samples_to_target"] for r in rs])
        metrics[name] = {"speedup_vs_sync": speed, "samples_to_target": to_target,
                         "seconds_to_target": mean_std([r["seconds_to_target"] for r in rs]),
                         "samples_per_s": mean_std([r["samples_per_s"] for r in rs]),
                         "reward_last5": mean_std([r["reward_last5"] for r in rs]),
                         "weight_sync_seconds": mean_std([r.get("weight_sync_seconds") for r in rs]),
                         "runs": rs}
        table.append({"variant": variant, "cluster": cluster, "samples/s": speed["mean"] * base,
                      "speedup_vs_sync": speed["mean"], "+-": speed["std"],
                      "samples_to_target": to_target["mean"], "reached": f"{to_target['n']}/{to_target['of']}",
                      "reward_last5": metrics[name]["reward_last5"]["mean"]})
    print_table(table)
    summaries = [r for rs in runs.values() for r in rs]
    config = {"variants": variants, "seeds": seeds, "steps": args.steps, "groups_per_step": args.groups,
              "group_size": args.group_size, "new_tokens": args.new_tokens or agreed(summaries, "new_tokens"),
              "engine": agreed(summaries, "engine"), "update_mode": agreed(summaries, "update_mode"),
              "target": args.target, "size": args.size, "model": SIZES[args.size],
              "lr": args.lr, "warmstart_lr": args.warmstart_lr, "overrides": args.overrides,
              "splits": args.splits or "1:1",
              "baseline": f"sync on {base_cluster}"}
    print(write_result("async_speedup", config, metrics, args.out_dir))


if __name__ == "__main__":
    main()
