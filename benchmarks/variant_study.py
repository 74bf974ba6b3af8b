"""Benchmark ``variant_study``: held-out accuracy per sample of every variant at every staleness.

The question: at an equal sample budget, how much do the staleness corrections
(rollout IS, decoupled PPO, D-ARL and its ablations) buy over naive asynchronous PPO, and how
far is each from synchronous training? Each run is the real main job (``python -m launch.train``)
on a generated task with a held-out test split (default ``data=countdown``), started from a
format-only warm start (``tools/task_warmstart.py``) so the skill is learned by RL. The trainer
checkpoints every ``--eval-every`` steps; after the run ``megatron_darl.eval.heldout`` scores
every checkpoint on the test split (greedy, and ``--eval-samples`` sampled responses per prompt at
the training temperature) and deletes it. Per run the record keeps:

- ``curve``: ``[step, samples_consumed, wall_seconds, test_accuracy, samples_generated,
  greedy_accuracy, sampled_accuracy]`` per evaluation, samples consumed = step x B x G (what
  enters training; the same for every case), test_accuracy the ``--metric`` one;
- ``final_accuracy``, ``samples_to_target`` (samples consumed at the first evaluation at or above
  ``--target``; None when never), ``wall_seconds``, ``staleness_mean`` (realized: mean age t - v
  of the trained groups, each step weighted by the groups it trained), ``groups_trained_per_step``;
- ``train``: per evaluation interval the means of the training reward, the staleness of the
  selected samples, ``weight_ess``, ``weight_clip_frac`` (and mean weight and capped share by
  advantage sign, ``weight_mean_pos/neg``, ``weight_clip_frac_pos/neg``), ``clip_frac_low/high``, the score,
  and the selected-version histogram summed over the interval.

Cases are ``<variant>_eta<eta>``: ``sync`` (eta 0, once per seed) and, per max staleness eta,
``async`` (naive), ``decoupled`` (AReaL's decoupled PPO: own-behavior weights with the masking cap
at 2.0), ``darl``, ``darl_once`` (no replay), ``darl_nomis``, ``darl_nofilter``, and ``darl_keta``
(darl with the window K = eta + 1; the tables name it ``darl_k<eta + 1>``); ``async_is`` (async +
rollout IS at 2.0, verl's truncating form) on request. The D-ARL cases keep their preset's
window, the paper's K = 4; the queue baselines (``async``, ``async_is``, ``decoupled``) train
each group once, oldest first, and get K = eta + 1: no window of theirs, and a shorter one would
evict groups the bound let the worker generate before they are trained. Each case is a preset
(``configs/algorithm/<case>.yaml``, ``algorithm=<case>`` in any run); the overrides a case adds
are the study's settings (the baselines' queue order, the window), never what makes the variant.
Degenerate groups (all rewards equal) are dropped, as the spec says, and refilled
(``replay.fill_batch=true``: DAPO's dynamic sampling; ``--no-fill``: dropped without refill;
``--keep-degenerate``: kept, against the spec, for comparison).

How the staleness is made real. The trainer waits for B new groups per step, the rollout worker
may start groups up to ``(t + eta + 1) * B``, and a batch engine reserves its whole batch or
nothing. With ``--rollout-batch step`` (default; B groups per engine call) the worker fills the
bound and stays eta versions ahead: the buffer holds a backlog of ``eta * B`` groups, and the
queue baselines (``algorithm.score=oldest``) train every group eta versions after it was
generated. ``--rollout-batch window`` ((eta + 1) * B per call) waits for room for the whole batch,
so the worker generates one batch every eta + 1 versions and the trained age cycles 0..eta.
Dropping degenerate groups without refill collapses the staleness: the step still waits for B
arrivals, degenerate ones included, and trains the non-degenerate ones it holds, so with fewer
than B of those arriving per version none waits. Measured on CPU (tiny policy, B 16, G 8, eta 4,
seed 0; realized staleness = mean age of the trained groups): step and degenerate groups kept
4.00 from step 10 on (3.43 over the run); step with them dropped 1.00, with 6.5 of 16 groups
trained a step; window with them dropped 0.98 (async) and 1.55 (darl), 17 of 40 async steps
training nothing. With ``replay.fill_batch`` the hub drops them on arrival and gives their
starts back to the bound, so a step waits for B trainable groups and the backlog is of trainable
groups again; but the trained age reaches eta only where the worker outpaces the trainer by the
degenerate share too (measured with the filter and generation-bound: 0.75 at eta 4). So every run
sets ``loop.wait_for_bound=true``: each step waits until every start the bound allows under the
published version has arrived ((eta + 1) * B untrained groups held), so the queue baselines train
groups eta versions old from step eta + 1 on, whatever the relative speeds, and the trainer idles
while the workers fill the bound (docs/algorithm.md, section 3, "Staleness studies").
D-ARL's variants choose from the same buffer by their own score.

    python benchmarks/variant_study.py --out-dir OUT --partial OUT/partial.json --budget 540  # GPU
    python benchmarks/variant_study.py --cpu --size tiny --steps 120 --variants sync,async --staleness 4,8

A full study outlasts one 10-minute device call: ``--partial FILE`` keeps every finished run
(with the settings it ran under) and skips it when started again; ``--budget SECONDS`` starts no
run past that point and exits with status 3 while runs remain. The record is written once
every run of the plan is in the partial file. A call that ends mid-run loses little with
``--reuse-trained``: the next call resumes a run cut short in training from its latest checkpoint
(every ``--eval-every`` steps) and goes on with an evaluation from the points already written
(``gpu/variant_study.sh`` runs it so on the GPU machine); it trusts that ``--run-root``
holds only this study's runs. When the time runs out before the plan does, ``--record-finished``
writes the record of the runs that finished (on any machine: the partial file names its
device) and lists the rest under ``config.left_out``; ``--more-partials`` adds the partial files
of further device calls, each seed block with the warm start its machine fitted (the plan in
``gpu/variant_study.sh``). ``tools/variant_report.py`` draws the
plot and the table of docs/results.md from the record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.async_speedup import SIZES, load_partial, mean_std, run_once, save_partial  # noqa: E402
from benchmarks.record import device_name, print_table, write_result  # noqa: E402
from megatron_darl import timeline  # noqa: E402
from megatron_darl.eval.heldout import list_checkpoints  # noqa: E402
from megatron_darl.transport.shape import StalenessBound  # noqa: E402
from tools.variant_report import t_interval  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# case -> (configs/algorithm preset, extra overrides, its window K: an int, or None for eta + 1)
CASES: dict[str, tuple[str, tuple[str, ...], int | None]] = {
    "sync": ("sync", (), 1),
    # the queue baselines train each group once, oldest first; their window holds every version
    # the bound lets the worker run ahead (K = eta + 1), else groups leave it untrained
    "async": ("async", ("algorithm.score=oldest",), None),
    "async_is": ("async_is", ("algorithm.score=oldest",), None),
    "decoupled": ("decoupled", ("algorithm.score=oldest",), None),  # the preset: AReaL's masked cap
    "darl": ("darl", (), 4),
    "darl_once": ("darl_once", (), 4),  # D-ARL without replay
    "darl_nomis": ("darl_nomis", (), 4),
    "darl_nofilter": ("darl_nofilter", (), 4),
    "darl_keta": ("darl", (), None),  # D-ARL with the window of the bound, K = eta + 1
    # diagnostics of the corrections (not in the default plan): the decoupled objective without
    # its behavior weights (PPO ratio against pi_t on the stale queue); D-ARL with replay capped
    # at two selections per group
    "async_prox": ("sync", ("algorithm.score=oldest",), None),
    "darl_twice": ("darl", ("replay.max_replays=2",), 4),
}
DEFAULT_CASES = ("sync", "async", "decoupled", "darl", "darl_once", "darl_nomis", "darl_nofilter", "darl_keta")
TRAIN_KEYS = ("reward_mean", "staleness_mean", "selected_mean", "times_selected_max", "weight_ess",
              "weight_clip_frac", "weight_mean_pos", "weight_mean_neg", "weight_clip_frac_pos", "weight_clip_frac_neg",
              "clip_frac_low", "clip_frac_high", "selected_score_mean", "mean_ratio")


def plan_runs(cases: list[str], etas: list[int], seeds: list[int]) -> list[tuple[str, int, int]]:
    """(case, eta, seed) of every run: sync once per seed at eta 0, the others per eta."""
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(CASES)}")
    if any(e < 1 for e in etas):
        raise SystemExit(f"--staleness {etas}: every max staleness must be >= 1 (sync is eta 0)")
    plan = [("sync", 0, s) for s in seeds] if "sync" in cases else []
    return plan + [(c, e, s) for e in etas for c in cases if c != "sync" for s in seeds]


def case_overrides(case: str, eta: int, args) -> tuple[str, list[str]]:
    """The algorithm preset of a case and the Hydra overrides of its run."""
    preset, extra, _ = CASES[case]
    b = args.groups
    per_call = StalenessBound(eta, b).window if args.rollout_batch == "window" else b
    out = [f"algorithm.max_staleness={eta}", f"replay.k={window_k(case, eta)}", *extra,
           f"algorithm.ppo_minibatches={args.minibatches}", f"algorithm.group_size={args.group_size}",
           f"worker.groups_per_batch={per_call}", f"sampling.max_new_tokens={args.max_new_tokens}",
           f"data={args.data}", *args.data_overrides_prefixed, f"model.path={args.model_path}",
           f"loop.checkpoint_interval={args.eval_every}", "loop.keep_checkpoints=0",  # each is scored
           "loop.receive_timeout_s=1200", f"replay.drop_degenerate={str(not args.keep_degenerate).lower()}",
           f"replay.fill_batch={str(not (args.keep_degenerate or args.no_fill)).lower()}",  # staleness stays real
           "loop.wait_for_bound=true",  # each step waits for every start the bound allows: data eta old
           "eval.benchmarks=[]",  # no held-out points in the run: the study scores its checkpoints
           *args.overrides]
    return preset, out


def window_k(case: str, eta: int) -> int:
    """The window K of a case at max staleness ``eta``: the preset's (D-ARL's 4, sync's 1), or
    ``eta + 1`` for the queue baselines and ``darl_keta``."""
    k = CASES[case][2]
    return eta + 1 if k is None else k


def evaluate_run(run_dir: Path, args, devices: list[int]) -> list[dict]:
    """Score the run's checkpoints on the test split (``megatron_darl.eval.heldout``), delete them.

    Scored without partial credit: the accuracy is the share of exactly correct responses."""
    out = run_dir / "heldout.json"
    cmd = [sys.executable, "-m", "megatron_darl.eval.heldout", "--model-dir", args.model_path,
           "--run-dir", str(run_dir), "--data", args.data, "--out", str(out), "--delete", "--resume", "--no-progress",
           "--samples", str(args.eval_samples), "--temperature", str(args.eval_temperature),
           "--max-new-tokens", str(args.max_new_tokens), *args.data_overrides,
           f"{args.task_key}.split=test", f"{args.task_key}.num_prompts={args.test_prompts}",
           *([f"{args.task_key}.valid_chain_reward=0"] if args.task_key == "countdown" else [])]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    if not args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = str(devices[-1])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"held-out evaluation of {run_dir} failed ({proc.returncode}):\n"
                           + proc.stdout[-2000:] + proc.stderr[-3000:])
    return json.loads(out.read_text())["points"]


def _interval_means(rows: list[dict], lo: int, hi: int) -> dict:
    """Means of the training metrics over steps [lo, hi), and the summed selected histogram."""
    part = rows[lo:hi]
    out = {}
    for key in TRAIN_KEYS:
        vals = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        out[key] = statistics.fmean(vals) if vals else None
    hists = [r.get("selected_hist") or [] for r in part]
    width = max((len(h) for h in hists), default=0)
    out["selected_hist"] = [sum(h[i] for h in hists if i < len(h)) for i in range(width)]
    return out


def summarize(rows: list[dict], points: list[dict], target: float, per_step: int,
              metric: str = "greedy") -> dict:
    """The run's curve, final accuracy, samples to target, realized staleness, diagnostics.

    Samples consumed at step s are ``s * per_step`` (B groups of G enter training per step in
    every variant); ``samples_generated`` also counts the backlog the rollout ran ahead.
    """
    curve, train, prev = [], [], 0
    for p in points:
        step = p["step"]
        row = rows[step - 1] if step > 0 else None
        wall = row["wall_seconds"] - rows[0]["wall_seconds"] if row else 0.0
        primary = p["accuracy_sampled"] if metric == "sampled" else p["accuracy"]
        curve.append([step, float(step * per_step), wall, primary,
                      row["samples_generated"] if row else 0.0, p["accuracy"], p.get("accuracy_sampled")])
        if step > prev:
            train.append({"step": step, **_interval_means(rows, prev, step)})
            prev = step
    reached = next((c for c in curve if c[3] >= target), None)
    # realized staleness: over the groups trained (a step that trained none has a mean of 0.0)
    trained = [(r["selected_mean"], r.get("groups_selected", 1.0)) for r in rows
               if isinstance(r.get("selected_mean"), (int, float)) and r.get("groups_selected", 1.0)]
    groups = sum(n for _, n in trained)
    return {"curve": curve, "train": train, "final_accuracy": curve[-1][3],
            "initial_accuracy": curve[0][3], "samples_to_target": reached[1] if reached else None,
            "steps": len(rows), "samples_generated": rows[-1]["samples_generated"],
            "samples_trained": rows[-1].get("samples_trained"),
            "wall_seconds": rows[-1]["wall_seconds"] - rows[0]["wall_seconds"],
            "staleness_mean": sum(v * n for v, n in trained) / groups if groups else None,
            "groups_trained_per_step": groups / len(rows) if rows and "groups_selected" in rows[-1] else None,
            "train_reward_last": statistics.fmean(r["reward_mean"] for r in rows[-max(1, len(rows) // 10):])}


def aggregate(done: dict[str, dict], plan: list[tuple[str, int, int]]) -> tuple[dict, list[dict]]:
    """Per case: mean and std over its runs, one a seed, two where a seed's blocks ran from two
    warm-start fits and each had its own run of the case (``name@fit``: sync, the pairs' base);
    the runs themselves; and the printed table rows."""
    metrics, table = {}, []
    cases = sorted({(c, e) for c, e, _ in plan}, key=lambda ce: (ce[1], list(CASES).index(ce[0])))
    for case, eta in cases:
        runs = [run for c, e, s in plan if (c, e) == (case, eta)
                for name, run in done.items() if name.split("@")[0] == f"{case}_eta{eta}_s{s}"]
        m = {key: mean_std([r[key] for r in runs]) for key in
             ("final_accuracy", "samples_to_target", "wall_seconds", "staleness_mean",
              "initial_accuracy", "train_reward_last")}
        m["groups_trained_per_step"] = mean_std([r.get("groups_trained_per_step") for r in runs])
        ci = t_interval([r["final_accuracy"] for r in runs])
        metrics[f"{case}_eta{eta}"] = {**m, "final_accuracy_ci95": ci, "variant": case, "max_staleness": eta,
                                       "window_k": window_k(case, eta), "runs": runs}
        table.append({"case": case, "eta": eta, "K": window_k(case, eta), "final_acc": m["final_accuracy"]["mean"],
                      "ci95+-": ci["half"], "to_target": m["samples_to_target"]["mean"],
                      "reached": f"{m['samples_to_target']['n']}/{m['samples_to_target']['of']}",
                      "staleness": m["staleness_mean"]["mean"], "wall_s": m["wall_seconds"]["mean"]})
    return metrics, table


def warm_start(args) -> tuple[str, str]:
    """(path, cache key) of the format-only initial policy of the task, fitted when absent."""
    from tools.task_warmstart import ensure_task_policy, load_configs, task_cache_key

    shape = [f"warmstart.model.{k}={v}" for k, v in SIZES[args.size].items()]
    ws_set = [*shape, f"warmstart.steps={args.warmstart_steps}", f"warmstart.lr={args.warmstart_lr}",
              f"warmstart.num_prompts={args.warmstart_prompts}"]
    if args.warmstart_cache_dir:
        ws_set.append(f"warmstart.cache_dir={args.warmstart_cache_dir}")
    data, ws = load_configs(args.data, args.data_overrides, ws_set)
    if args.cpu:
        ws.device = "cpu"
    args.task_key = data.task
    path = ensure_task_policy(data, ws)
    return str(path), f"{task_cache_key(data, ws)}:{weights_digest(path)}"


def weights_digest(model_dir: Path) -> str:
    """Hash of the fitted weights. The cache key names the warm start's settings, not its result:
    a GPU fit was not bitwise reproducible (two 2x H200 machines, same key: held-out accuracy 0.057
    and 0.037 before RL), so a partial file must not mix runs from two fits. The fit now runs
    deterministic kernels on a GPU (``launch.warmstart_fit.deterministic_fit``), and three 2x H200
    machines have fitted the same digest (cecc3b915f3ab736): a block on a fresh machine then pairs
    with the sync run of an earlier one. The digest stays in the key, since other kinds may differ."""
    digest = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(DEFAULT_CASES), help=f"cases among {', '.join(CASES)}")
    p.add_argument("--staleness", default="1,4,8", help="max staleness values (eta) of the async cases")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=300, help="trainer steps per run (the sample budget)")
    p.add_argument("--groups", type=int, default=16, help="groups per step B")
    p.add_argument("--group-size", type=int, default=8, help="responses per group G")
    p.add_argument("--minibatches", type=int, default=1, help="algorithm.ppo_minibatches M (all cases)")
    p.add_argument("--lr", type=float, default=3e-5, help="RL learning rate (trainer.optimizer.lr)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rollout-batch", choices=("window", "step"), default="step",
                   help="groups per engine call: B (the worker stays eta versions ahead) or (eta+1)*B")
    p.add_argument("--keep-degenerate", action="store_true",
                   help="replay.drop_degenerate=false in every run (the spec drops them; kept here "
                        "for comparison)")
    p.add_argument("--no-fill", action="store_true",
                   help="replay.fill_batch=false: degenerate groups dropped but not refilled (steps train "
                        "fewer than B groups and the staleness collapses; the docstring)")
    p.add_argument("--data", default="countdown", help="configs/data preset of a generated task")
    p.add_argument("--data-set", action="append", default=[], dest="data_overrides",
                   help="data KEY=VALUE override, e.g. countdown.max_numbers=7 (train and test)")
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    p.add_argument("--test-prompts", type=int, default=512, help="held-out prompts per evaluation")
    p.add_argument("--eval-samples", type=int, default=4,
                   help="sampled responses per test prompt besides the greedy one (0: greedy only)")
    p.add_argument("--eval-temperature", type=float, default=1.0, help="temperature of the sampled pass")
    p.add_argument("--metric", choices=("greedy", "sampled"), default="greedy",
                   help="which held-out accuracy the summaries and the target use")
    p.add_argument("--target", type=float, default=0.5, help="test accuracy target")
    p.add_argument("--size", choices=sorted(SIZES), default="57m")
    p.add_argument("--warmstart-steps", type=int, default=1200)
    p.add_argument("--warmstart-lr", type=float, default=3e-3)
    p.add_argument("--warmstart-prompts", type=int, default=16384)
    p.add_argument("--warmstart-cache-dir", default="", help="where the fitted policy is kept (default: "
                   "the warm start's cache, ~/.cache/megatron_darl/warmstart)")
    p.add_argument("--cluster", default="", help="cluster preset (default: cpu with --cpu, else gpu1)")
    p.add_argument("--cpu", action="store_true", help="CPU run (cluster=cpu)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once, each on its own GPU slot")
    p.add_argument("--runs-per-gpu", type=int, default=1,
                   help="slots that share one GPU slot (a 57M run leaves an H100 mostly idle)")
    p.add_argument("--gpus-per-run", type=int, choices=(1, 2), default=1,
                   help="1: trainer and rollout share a GPU (gpu1); 2: trainer and rollout GPUs")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    p.add_argument("--run-root", type=Path, default=Path("/tmp/variant_study_runs"))
    p.add_argument("--partial", type=Path, default=None, help="JSON of finished runs (resumable)")
    p.add_argument("--budget", type=float, default=None, help="seconds after which no run starts (exit 3)")
    p.add_argument("--seed-major", action="store_true", help="run every case of a seed before the next seed")
    p.add_argument("--reuse-trained", action="store_true",
                   help="what an earlier call left under --run-root goes on: a run whose training "
                        "finished is only evaluated (from its points so far), one cut short in "
                        "training resumes from its latest checkpoint (loop.resume)")
    p.add_argument("--warmstart-only", action="store_true",
                   help="fit (or find) the initial policy, print its path and digest, run nothing: "
                        "a device call that has time left prepares the next one's study")
    p.add_argument("--record-finished", action="store_true",
                   help="write the record of the plan's runs that --partial holds and name the others "
                        "(config.left_out); fits and runs nothing: a study cut short by a device "
                        "budget or a Slurm time limit still reports what finished")
    p.add_argument("--more-partials", type=Path, action="append", default=[], metavar="FILE",
                   help="with --record-finished: a further partial file (one per device call, each with "
                        "its own warm start) whose runs join the record; repeat it per file")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    args.data_overrides_prefixed = [f"data.{o}" for o in args.data_overrides]
    args.cluster = args.cluster or ("cpu" if args.cpu else "gpu1" if args.gpus_per_run == 1 else "gpu2")
    if args.parallel < 1 or (args.cpu and args.parallel > 1):
        p.error("--parallel must be >= 1, and 1 on CPU (the runs would share the cores)")
    if args.runs_per_gpu < 1:
        p.error("--runs-per-gpu must be >= 1")
    if args.metric == "sampled" and args.eval_samples < 1:
        p.error("--metric sampled needs --eval-samples >= 1")
    missing = [f for f in [args.partial, *args.more_partials] if f is None or not f.exists()]
    if args.record_finished and missing:
        p.error(f"--record-finished reads the runs from --partial and --more-partials; missing: {missing}")
    if args.more_partials and not args.record_finished:
        p.error("--more-partials is read by --record-finished only")
    return args


def settings(args, ws_key: str) -> dict:
    """What makes two runs comparable: a partial file only mixes runs made under these."""
    keys = ("steps", "groups", "group_size", "minibatches", "lr", "max_new_tokens", "rollout_batch", "keep_degenerate", "no_fill",
            "data", "data_overrides", "eval_every", "test_prompts", "eval_samples", "eval_temperature",
            "metric",
            "size", "cluster", "overrides")
    return {**{k: getattr(args, k) for k in keys}, "warmstart": ws_key}


def slot_devices(slot: int, args) -> tuple[list[int], list[str]]:
    """GPUs of a parallel slot and the overrides that pin the run to them (none on CPU).

    ``--runs-per-gpu`` slots share one GPU slot; every process of every run at once then gets an
    equal share of the cores (the launcher's default share assumes one run per machine)."""
    if args.cpu:
        return [], []
    first = (slot // args.runs_per_gpu) * args.gpus_per_run
    gpus = list(range(first, first + args.gpus_per_run))
    threads = max(1, (os.cpu_count() or 1) // (2 * args.parallel))  # a trainer and a rollout each
    return gpus, [f"cluster.trainer_devices=[{gpus[0]}]", f"cluster.rollout_devices=[{gpus[-1]}]",
                  f"cluster.threads_per_process={threads}"]


def trained_run(run_dir: Path, steps: int) -> dict | None:
    """The rows of a run that finished training but not its evaluation (a device call ended
    during it), or None. The points scored before that call ended are in its heldout.json (each
    written as scored): the evaluation goes on from there."""
    metrics = run_dir / "metrics.jsonl"
    last = run_dir / "checkpoints" / f"step_{steps:06d}"
    if not metrics.is_file() or not (last.is_dir() or (run_dir / "heldout.json").is_file()):
        return None
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("kind") != "heldout"]  # training steps only (eval.* points)
    if len(rows) < steps:
        return None
    print(f"{run_dir.name}: trained earlier, evaluating its remaining checkpoints", flush=True)
    return {"rows": rows[:steps], "launch_seconds": None}


def run_case(case: str, eta: int, seed: int, slot: int, args) -> dict:
    """One run: train, score its checkpoints, summarize."""
    t0 = time.monotonic()
    preset, overrides = case_overrides(case, eta, args)
    gpus, pin = slot_devices(slot, args)
    run_args = SimpleNamespace(**{**vars(args), "overrides": overrides + pin})
    run_dir = args.run_root / f"{case}_eta{eta}_s{seed}"
    result = trained_run(run_dir, args.steps) if args.reuse_trained else None
    if result is None:
        resume = args.reuse_trained and bool(list_checkpoints(run_dir))
        if resume:  # cut short in training by an earlier call: on from its latest checkpoint
            print(f"{run_dir.name}: resuming its training from its latest checkpoint", flush=True)
            run_args.overrides = [*run_args.overrides, "loop.resume=true"]
        result = run_once(preset, seed, args.cluster, run_args, run_dir, fresh=not resume)
    t_eval = time.monotonic()
    points = evaluate_run(run_dir, args, gpus)
    out = summarize(result["rows"], points, args.target, args.groups * args.group_size, args.metric)
    return out | {"seed": seed, "launch_seconds": result["launch_seconds"],  # the training process
                  "eval_seconds": time.monotonic() - t_eval,  # with the launch phases: where the minutes go
                  "launch_phases": timeline.saved_phases(run_dir),
                  "run_seconds": time.monotonic() - t0}


def run_plan(plan: list[tuple[str, int, int]], done: dict, args, run_config: dict) -> list[str]:
    """Run what ``done`` lacks, ``args.parallel`` at a time (one slot of GPUs each), saving each
    finished run; returns the runs left: failed ones (named, with their error, as they fail; the
    others run on) and those the budget kept from starting."""
    todo = [(c, e, s) for c, e, s in plan if f"{c}_eta{e}_s{s}" not in done]
    started, slowest, lock = time.monotonic(), 0.0, threading.Lock()
    free, running, failed = list(range(args.parallel)), {}, []
    with ThreadPoolExecutor(args.parallel) as pool:
        while todo or running:
            over = args.budget is not None and time.monotonic() - started + slowest > args.budget
            while todo and free and not over:
                case, eta, seed = todo.pop(0)
                slot = free.pop(0)
                running[pool.submit(run_case, case, eta, seed, slot, args)] = (f"{case}_eta{eta}_s{seed}", slot)
            if not running:
                break
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in finished:
                key, slot = running.pop(fut)
                free.append(slot)
                if fut.exception() is not None:  # the others run on; this one stays in the plan
                    failed.append(key)
                    print(f"{key} FAILED: {fut.exception()}", flush=True)
                    continue
                summary = fut.result()
                with lock:
                    done[key] = summary
                    save_partial(args.partial, run_config, done, device=device_name())
                slowest = max(slowest, summary["run_seconds"])
                stale = summary["staleness_mean"]  # None: no group trained (all degenerate, dropped)
                print(f"{key}: test accuracy {summary['initial_accuracy']:.3f} -> "
                      f"{summary['final_accuracy']:.3f}, realized staleness "
                      f"{'-' if stale is None else f'{stale:.2f}'}, {summary['run_seconds']:.0f} s", flush=True)
    return failed + [f"{c}_eta{e}_s{s}" for c, e, s in todo]


def finished_runs(args) -> tuple[dict[str, dict], str, dict]:
    """The runs of ``--partial`` and ``--more-partials``, the device they ran on and the record's
    settings. Each file may hold its own warm start (a device call on a fresh machine fits one:
    a seed block per call), named in each of its runs (``warmstart``) and listed in the settings;
    every other setting, and the device, must agree, and a run in two files must be the same run
    (a warm machine's partial file keeps the earlier calls' runs)."""
    done, device, keys = {}, None, []
    for path in [args.partial, *args.more_partials]:
        saved = json.loads(path.read_text())
        key = saved.get("config", {}).get("warmstart", "")
        got = load_partial(path, settings(args, key))
        if not saved.get("device"):  # this machine's name would mislabel runs made on the GPU machine
            raise SystemExit(f'{path}: names no device its runs ran on (written before partial files '
                             'did); add "device": "<torch.cuda.get_device_name(0) there, or cpu>" to it')
        if device is not None and saved["device"] != device:
            raise SystemExit(f"{path}: its runs ran on {saved['device']}, the others on {device}")
        got = {name: {**run, "warmstart": run.get("warmstart", key)} for name, run in got.items()}
        # one run name from two fits (sync in each seed block on a fresh machine): both kept
        got = {(f"{n}@{key.rsplit(':', 1)[-1]}" if n in done and done[n]["warmstart"] != r["warmstart"] else n): r
               for n, r in got.items()}
        clash = sorted(n for n in set(got) & set(done) if got[n] != done[n])  # a later call's file of
        if clash:  # the same warm machine holds the earlier runs too: the same, not a clash
            raise SystemExit(f"{path}: runs {clash} are in an earlier partial file with other results")
        done.update(got)
        device = saved["device"]
        keys += [key] if key not in keys else []
    return done, device, settings(args, keys[0] if len(keys) == 1 else keys)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plan = plan_runs(args.variants.split(","), [int(e) for e in args.staleness.split(",") if e],
                     [int(s) for s in args.seeds.split(",")])
    if args.seed_major:  # every case of seed 0 first: a call cut short still compares the cases
        plan.sort(key=lambda run: run[2])
    device, left_out = None, []
    if args.record_finished:  # each partial file names its warm start; the other settings must match
        done, device, run_config = finished_runs(args)
        left_out = [f"{c}_eta{e}_s{s}" for c, e, s in plan if f"{c}_eta{e}_s{s}" not in done]
        plan = [(c, e, s) for c, e, s in plan if f"{c}_eta{e}_s{s}" in done]
        if not plan:
            raise SystemExit(f"{args.partial}: none of the plan's runs finished; no record written")
        print(f"recording {len(plan)} finished runs; left out: {', '.join(left_out) or 'none'}")
    else:
        args.model_path, ws_key = warm_start(args)
        if args.warmstart_only:
            print(f"initial policy {args.model_path} ({ws_key})")
            return
        run_config = settings(args, ws_key)
        done = load_partial(args.partial, run_config)
        left = run_plan(plan, done, args, run_config)
        if left:
            why = f"budget of {args.budget:.0f} s reached" if args.budget is not None else "runs failed"
            print(f"{why}; {len(left)} runs left: {', '.join(left)}")
            sys.exit(3)
    metrics, table = aggregate(done, plan)
    print_table(table)
    config = {**run_config, "variants": args.variants.split(","), "staleness": args.staleness,
              "seeds": args.seeds, "target": args.target, "model": SIZES[args.size],
              "warmstart_steps": args.warmstart_steps, "warmstart_lr": args.warmstart_lr,
              "samples_per_run": args.steps * args.groups * args.group_size,
              **({"left_out": left_out} if left_out else {})}
    print(write_result("variant_study", config, metrics, args.out_dir, device=device))


if __name__ == "__main__":
    main()
