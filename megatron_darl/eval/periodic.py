"""Held-out evaluation while training: which versions are scored, on which prompts, and how.

Why inside the run: ``eval/heldout.py`` scores a run's checkpoints afterwards, which needs a
checkpoint per point and a second model build. A run with ``eval.benchmarks`` set scores its own
versions as it goes, on a rollout engine that already holds them (``loop/heldout_eval.py`` carries
the requests and results over the control store), so the curve costs only the generations.

This module is the pure part: ``PeriodicEvalConfig`` (the ``eval.*`` keys), ``is_due`` (the
schedule), ``heldout_sets`` (benchmark names -> prompt records) and ``score_version`` (one point:
every set through ``harness.evaluate_benchmark``). Benchmark names are those of
``configs/eval/benchmarks.yaml`` plus ``heldout``: the run's own generated task, held out:

- ``data.task=builtin``: prompts drawn with the next seed that the training set does not
  contain (the arithmetic task has only ~4k distinct problems, so most of another seed's draws
  are training prompts and are dropped);
- ``data.task=countdown``: its hash-held-out ``split=test``;
- a file dataset has no held-out split: ``heldout`` is skipped there (one log line), so the
  default config stays valid for every dataset; name a benchmark instead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict
from typing import Any

from megatron_darl.data.loaders import load_dataset
from megatron_darl.eval.benchmarks import HELDOUT, TABLE, benchmark_data
from megatron_darl.eval.config import EvalConfig, PeriodicEvalConfig
from megatron_darl.eval.harness import BenchmarkResult, evaluate_benchmark, take_limit
from megatron_darl.rewards import reference_check

log = logging.getLogger(__name__)


def is_due(cfg: PeriodicEvalConfig, version: int, final: bool) -> bool:
    """Whether ``version`` is scored: 0 (``at_start``), the final one (``at_end``), every N-th after 0."""
    if not cfg.enabled:
        return False
    return ((version == 0 and cfg.at_start) or (final and cfg.at_end)
            or (cfg.every_n_steps > 0 and version > 0 and version % cfg.every_n_steps == 0))


def planned(cfg: PeriodicEvalConfig, data) -> list[str]:
    """The benchmarks a run with ``data`` evaluates: ``eval.benchmarks`` less a ``heldout`` its
    dataset has none of (the trainer asks for points only when this is not empty)."""
    return [n for n in cfg.benchmarks if n != HELDOUT or heldout_data(data) is not None]


def heldout_data(data) -> Any:
    """The ``DataConfig`` of ``heldout`` for the run's ``data``, or None when it has no held-out split."""
    if data.source != "builtin":
        return None
    if data.task == "countdown":
        return dataclasses.replace(data, name=HELDOUT, countdown=dataclasses.replace(data.countdown, split="test"))
    return dataclasses.replace(data, name=HELDOUT, builtin=dataclasses.replace(data.builtin, seed=data.builtin.seed + 1))


def _heldout_records(data, limit: float) -> list:
    """The held-out prompts of the run's generated task (see the module docstring)."""
    records = load_dataset(heldout_data(data)).records
    if data.task == "builtin":  # drop every problem the run trains on, and repeats
        seen = {r.prompt for r in load_dataset(data).records}
        unseen = []
        for r in records:
            if r.prompt not in seen:
                seen.add(r.prompt)
                unseen.append(r)
        records = unseen
    return take_limit(records, limit)


def heldout_sets(cfg: PeriodicEvalConfig, data, reward=None) -> dict[str, list]:
    """``{benchmark: its first eval.limit prompt records}``, ``heldout`` under the dataset's name
    (``data.name``) and left out (logged) for a file dataset. Raises ``ValueError`` when a set has no prompts."""
    sets = {}
    for name in cfg.benchmarks:
        if name == HELDOUT:
            if heldout_data(data) is None:
                log.info("eval: data=%s (a file) has no held-out split: 'heldout' skipped; name a benchmark "
                         "of configs/eval/benchmarks.yaml in eval.benchmarks instead", data.name)
                continue
            records = _heldout_records(data, cfg.limit)
        else:
            bench = benchmark_data(name, TABLE)
            records = take_limit(load_dataset(bench, reference_check(bench.task, reward)).records, cfg.limit)
        if not records:
            raise ValueError(f"eval.benchmarks: {name!r} has no prompts to evaluate")
        key = data.name if name == HELDOUT and data.name not in cfg.benchmarks else name
        sets[key] = records  # heldout's points are named after the task: heldout/builtin/avg@1
    return sets


def harness_config(cfg: PeriodicEvalConfig, max_new_tokens: int, reward=None) -> EvalConfig:
    """The harness's settings for one version (the sets are already limited)."""
    kwargs = {"reward": reward} if reward is not None else {}
    return EvalConfig(n=cfg.n, ks=list(cfg.ks), temperature=cfg.temperature, top_p=1.0,
                      max_new_tokens=cfg.max_new_tokens or max_new_tokens, seed=cfg.seed,
                      batch_prompts=cfg.batch_prompts, limit=-1, score_workers=1, progress=False, **kwargs)


def score_version(version: int, sets: dict[str, list], engine, tokenizer, ecfg: EvalConfig) -> dict[str, Any]:
    """One point: ``{"version", "seconds", "results": {benchmark: BenchmarkResult as a dict}}``."""
    start = time.monotonic()
    results: dict[str, BenchmarkResult] = {
        name: evaluate_benchmark(name, records, engine, tokenizer, ecfg) for name, records in sets.items()}
    return {"version": version, "seconds": time.monotonic() - start,
            "results": {name: asdict(r) for name, r in results.items()}}


def point_metrics(point: dict[str, Any]) -> dict[str, float]:
    """The logged scalars of a point: ``heldout/<benchmark>/avg@<n>``, ``.../pass@k``, lengths."""
    out: dict[str, float] = {}
    for name, r in point.get("results", {}).items():
        prefix = f"heldout/{name}"
        out[f"{prefix}/avg@{r['n']}"] = float(r["avg_at_n"])
        out |= {f"{prefix}/{k}": float(v) for k, v in r["pass_at_k"].items()}
        out[f"{prefix}/prompts"] = float(r["num_prompts"])
        out[f"{prefix}/mean_response_tokens"] = float(r["mean_response_tokens"])
        out[f"{prefix}/truncated_fraction"] = float(r["truncated_fraction"])
    out["heldout_seconds"] = float(point.get("seconds", 0.0))
    return out
