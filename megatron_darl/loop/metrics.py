"""Per-step metrics (docs/guide.md, What a run writes): reduced over DP, written, shown, plotted, summarised.

Each DP shard's planner returns a ``StepStats`` of *sums* (rewards, tokens, histogram counts,
weight moments; ``stats.py``), so one all-reduce per reduction kind gives exact global values
whatever the DP size; ``step_metrics`` turns the reduced statistics into the logged means and
ratios. ``MetricsLogger`` (trainer rank 0 only)
writes every step to ``<run_dir>/metrics.jsonl`` (the source of truth: a resumed run reads it
back, so cumulative counters, the plot and ``summary.json`` span restarts; records of steps a
resume runs again move to ``metrics.superseded.jsonl`` at its first new step, so a resume that
fails before one changes nothing and no record is ever deleted), TensorBoard, and
W&B when configured (imported lazily: a missing package or network never stops training), and
drives a live tqdm bar. Held-out points (``eval.*``, ``loop.heldout_eval``) are records of their
own in the same file, marked ``"kind": "heldout"`` (``is_heldout``; readers of training steps
skip them). ``close`` writes ``progress.png`` and ``summary.json``. A full disk
stops none of it: the jsonl and TensorBoard writers log once and retry at the next record
(``metric_writers``), and ``close`` says what it could not write instead of raising.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from megatron_darl.eval.periodic import point_metrics
from megatron_darl.loop.config import LoopConfig
from megatron_darl.loop.metric_writers import LineAppender, Outage, TensorBoardEvents
from megatron_darl.loop.plots import plot_progress
from megatron_darl.step.stats import CACHE_SOURCES, StepStats

log = logging.getLogger(__name__)
HISTOGRAMS = ("staleness_hist", "selected_hist")
SUPERSEDED = "metrics.superseded.jsonl"  # records of steps a resume ran again, never deleted
HELDOUT_KIND = "heldout"  # ``kind`` of a held-out point's record in metrics.jsonl (training records have none)


def _ratio(num: float, den: float, empty: float = 0.0) -> float:
    return num / den if den > 0 else empty


def _hist_mean(hist: torch.Tensor) -> float:
    total = float(hist.sum())
    return _ratio(float((hist * torch.arange(hist.numel())).sum()), total)


def step_metrics(stats: StepStats, trainer: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Logged metrics from DP-reduced statistics plus the trainer's step result and timings.

    ``trainer`` may carry ``clip_frac_low``, ``clip_frac_high``, ``loss``, ``grad_norm``,
    ``trainer_tokens_per_s``, ``rollout_tokens_per_s``, ``weight_sync_seconds``, ``lr``: they are
    copied as they are. Histograms are lists indexed by staleness ``t - v`` (last bin: older).
    """
    g = lambda k: float(getattr(stats, k))  # noqa: E731
    generated = g("samples_received") + g("samples_degenerate")  # replay.fill_batch drops count too
    out: dict[str, Any] = {
        # of every sample that arrived, the groups replay.fill_batch dropped included
        "reward_mean": _ratio(g("reward_sum") + g("reward_sum_degenerate"), generated),
        "response_length": _ratio(g("response_tokens_received") + g("response_tokens_degenerate"), generated),
        "groups_received": g("groups_received"),  # that entered the buffer (fill_batch: trainable)
        # replay.fill_batch: groups of equal rewards dropped on arrival (their starts given back),
        # and their share of the groups that arrived: the generation the filter costs
        "groups_degenerate": g("groups_degenerate"),
        "samples_degenerate": g("samples_degenerate"),
        "degenerate_share": _ratio(g("groups_degenerate"), g("groups_degenerate") + g("groups_received")),
        "samples_received": g("samples_received"),
        "samples_selected": g("samples_selected"),
        "groups_selected": g("groups_selected"),
        "dropped_stale": g("dropped_stale"),
        # the candidate pass: eligible groups, groups scored at t and passes (sums over DP)
        "candidate_groups": g("candidate_groups"),
        "groups_scored": g("groups_scored"),
        "logprob_passes": g("logprob_passes"),
        # rows (sample x version) the step needed: computed on its critical path, computed while it
        # waited for groups, reused (no row is computed twice: rows_duplicate stays 0)
        "logprob_rows_computed": g("rows_computed"),
        "logprob_rows_prefetched": g("rows_prefetched"),
        "logprob_rows_reused": g("rows_reused"),
        "logprob_rows_duplicate": g("rows_duplicate"),
        "logprob_cache_hit_rate": _ratio(g("rows_reused"), g("rows_reused") + g("rows_computed")),
        "prefetch_passes": g("prefetch_passes"),
        "score_mean": _ratio(g("score_sum"), g("score_count")),
        "score_max": g("score_max") if g("score_count") > 0 else 0.0,
        "selected_score_mean": _ratio(g("selected_score_sum"), g("groups_selected")),
        "weight_ess": _ratio(g("w_sum") ** 2, g("w_tokens") * g("w_sq_sum"), 1.0),
        "weight_clip_frac": _ratio(g("w_clipped"), g("w_tokens")),
        # by advantage sign: mean weight and capped share of A > 0 and A < 0 tokens
        **{f"weight_mean_{s}": _ratio(g(f"w_{s}_sum"), g(f"w_{s}_tokens"), 1.0) for s in ("pos", "neg")},
        **{f"weight_clip_frac_{s}": _ratio(g(f"w_{s}_clipped"), g(f"w_{s}_tokens")) for s in ("pos", "neg")},
        # engine vs trainer at equal version, over the tokens of samples generated at the
        # trainer's current version (every step in sync runs; rare when async): 0 tokens -> 0.0
        "mismatch_kl": _ratio(g("mismatch_k3_sum"), g("mismatch_tokens")),
        "mismatch_tokens": g("mismatch_tokens"),
        "times_selected_max": g("times_selected_max"),  # most times any selected group was trained
        "cache_bytes": g("cache_bytes"),
        "buffer_groups": g("buffer_groups"),
        "buffer_untrained": g("groups_untrained"),  # of them: selectable and never trained yet
        # log-prob rows filled this step: exact (parameter snapshots) and approximated (nearest)
        "backfill_snapshot": g("backfill_snapshot"),
        "backfill_nearest": g("backfill_nearest"),
        "backfill_own": g("backfill_own"),  # of both: own-version rows (the posterior's)
        "ref_rows": g("ref_rows"),  # KL term: reference rows computed this step (0 when off)
        "selected_staleness_max": g("selected_staleness_max"),  # -1: nothing selected
        # rows the cache holds at the end of the step, by source
        **{f"cache_rows_{src}": g(f"cache_rows_{src}") for src in CACHE_SOURCES},
    }
    if g("rescore_audits") > 0:  # replay.rescore_audit: the rule against scoring everything
        out["rescore_agreement"] = _ratio(g("rescore_agreement_sum"), g("rescore_audits"))
        out["rescore_score_gap"] = _ratio(g("rescore_score_gap_sum"), g("rescore_audits"))
        out["rescore_rule_scored"] = g("rescore_rule_scored")
    for name in HISTOGRAMS:
        hist = torch.as_tensor(getattr(stats, name), dtype=torch.float64)
        out[name] = [float(x) for x in hist.tolist()]
        out[name.replace("_hist", "_mean")] = _hist_mean(hist)
    out.update({k: float(v) for k, v in (trainer or {}).items()})
    return out


class WorkerRates:
    """Per-step rollout metrics from each worker's cumulative statistics (sent with its heartbeat).

    ``generation_seconds`` is the mean over workers of the seconds each engine generated since the
    last step (``generation_seconds_w<N>`` per worker), ``worker_sync_seconds`` the mean seconds a
    worker spent in weight syncs, ``worker_{flush,admit,collect}_seconds`` the mean seconds of the
    worker loop's own work outside the engine poll, and ``engine_batch_groups`` the groups per engine call (a batch
    engine generates fewer than its batch when the staleness bound admits fewer). The statistics
    arrive with the beat (once a second), so one step's value may lag; their means over steps don't.
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._last: dict[int, dict[str, float]] = {}

    def step(self, stats_of: Callable[[int], Mapping[str, float]]) -> dict[str, float]:
        """Metrics since the previous call; ``stats_of(worker)`` is its latest cumulative stats."""
        deltas = []
        for w in range(self.num_workers):
            now = {k: float(v) for k, v in stats_of(w).items()}
            before = self._last.get(w, {})
            # a statistic below its last value: a restarted worker process, counting from 0 again
            deltas.append({k: v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v for k, v in now.items()})
            self._last[w] = now
        get = lambda d, k: d.get(k, 0.0)  # noqa: E731
        out = {f"generation_seconds_w{w}": get(d, "engine_seconds") for w, d in enumerate(deltas)}
        out["generation_seconds"] = sum(get(d, "engine_seconds") for d in deltas) / max(len(deltas), 1)
        out["worker_sync_seconds"] = sum(get(d, "sync_seconds") for d in deltas) / max(len(deltas), 1)
        for why in ("gate", "weights"):  # engine empty: the staleness bound refused / no valid weights
            out[f"worker_idle_{why}_seconds"] = sum(get(d, f"idle_{why}_seconds") for d in deltas) / max(len(deltas), 1)
        for part in ("flush", "admit", "collect"):  # the worker loop's own time outside the engine poll
            out[f"worker_{part}_seconds"] = sum(get(d, f"{part}_seconds") for d in deltas) / max(len(deltas), 1)
        calls = sum(get(d, "engine_calls") for d in deltas)
        out["engine_batch_groups"] = _ratio(sum(get(d, "groups_finished") for d in deltas), calls)
        return out


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become None (and are reported), tensors become lists."""
    if torch.is_tensor(value):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes one record per step to jsonl, TensorBoard, W&B and the progress bar (rank 0)."""

    def __init__(self, cfg: LoopConfig, run_config: Mapping[str, Any] | None = None,
                 start_step: int = 0) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.start_step = start_step
        rows = read_metrics(self.path) if self.path.exists() else None
        kept = [r for r in rows or [] if _kept(r, start_step)]  # earlier steps (a resume), in file order
        self._kept = kept  # what the first new record leaves in the file (the resume's rewrite)
        self.history = [r for r in kept if not is_heldout(r)]  # training steps
        self.heldout = [r for r in kept if is_heldout(r)]  # held-out points (``log_heldout``)
        self._again = [r for r in rows or [] if not _kept(r, start_step)]  # steps run again
        self._last_step = int(self.history[-1]["step"]) if self.history else 0  # W&B's step so far
        self._rewrite = rows is not None  # the file is left as it is until the first new record
        last = self.history[-1] if self.history else {}
        self._wall_offset = float(last.get("wall_seconds", 0.0))
        self._generated = float(last.get("samples_generated", 0.0))
        self._trained = float(last.get("samples_trained", 0.0))
        self._idle_steps = 0  # steps of this launch that trained no sample (``_say_if_idle``)
        self._start = time.monotonic()
        self._file: LineAppender | None = None  # opened by the first record: no step, no history changed
        self._unopened: list[str] = []  # records before the file could be opened (a full disk)
        self._open_outage = Outage(str(self.path))
        self._tb = self._open_tensorboard()
        self._wandb = self._open_wandb(run_config or {})
        self.variant = str((run_config or {}).get("algorithm", {}).get("variant") or "train")  # the bar's name
        self._bar = self._open_bar(start_step)

    def _open(self) -> LineAppender:
        """At the first new record: records of steps from ``start_step`` on (they are run again)
        move to ``metrics.superseded.jsonl``, never deleted; the rewrite is atomic. Raises
        ``OSError`` when the disk cannot take that yet (the next record tries again)."""
        again = self._again
        if again:
            with (self.run_dir / SUPERSEDED).open("a") as f:
                f.writelines(json.dumps({**r, "superseded_at_step": self.start_step}) + "\n" for r in again)
            log.warning("%d record(s) of steps %d-%d are run again from step %d: kept in %s", len(again),
                        int(again[0]["step"]), int(again[-1]["step"]), self.start_step, SUPERSEDED)
            self._again = []
        if self._rewrite:
            old = self._kept
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in old))
            os.replace(tmp, self.path)
            self._rewrite = False
        return LineAppender(self.path)

    def _open_tensorboard(self) -> TensorBoardEvents | None:
        if not self.cfg.tensorboard:
            return None
        return TensorBoardEvents(self.run_dir / "tensorboard")

    def _open_wandb(self, run_config: Mapping[str, Any]):
        wb = self.cfg.wandb
        if wb.mode == "disabled":
            return None
        try:
            import wandb
        except ImportError:
            log.warning("loop.wandb.mode=%s but wandb is not installed: W&B logging skipped", wb.mode)
            return None
        return wandb.init(project=wb.project, entity=wb.entity or None,
                          name=wb.name or self.run_dir.name, mode=wb.mode, dir=str(self.run_dir),
                          config=without_secret(run_config), resume="allow")

    def _open_bar(self, start_step: int):
        from tqdm import tqdm

        return tqdm(total=self.cfg.steps, initial=start_step, disable=not self.cfg.progress_bar,
                    desc=self.variant, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Write step ``step``'s metrics everywhere; returns the record as written."""
        self._generated += float(metrics.get("samples_received", 0.0)) + float(metrics.get("samples_degenerate", 0.0))
        self._trained += float(metrics.get("samples_selected", 0.0))
        self._say_if_idle(step, metrics)
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()},
                  "samples_generated": self._generated, "samples_trained": self._trained,
                  "wall_seconds": self._wall_offset + time.monotonic() - self._start}
        self.history.append(record)
        self._write_jsonl(record)
        if self._tb is not None:
            self._tb.write(step, record)
        if self._wandb is not None:
            self._last_step = step
            self._wandb.log({k: v for k, v in record.items() if v is not None}, step=step)
        try:
            self._show(step, record)
        except OSError:  # the bar's stream on a full disk: the log line says it (metric_writers)
            pass
        return record

    def _say_if_idle(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Name a step that trained no sample (the first, then every 100th): at a policy that
        solves none of its prompts every group's samples get one reward, the spec leaves such
        groups out (``replay.drop_degenerate``), and the run would go on with unchanged weights
        and nothing in its log to say so."""
        if "samples_selected" not in metrics or float(metrics["samples_selected"]) > 0:
            return
        self._idle_steps += 1
        if self._idle_steps == 1 or self._idle_steps % 100 == 0:
            log.warning(
                "step %d trained no sample (%d such step(s) in this launch): none of the %d groups in "
                "the buffer could be selected (mean reward %.3f); groups whose samples all got the same "
                "reward are left out (replay.drop_degenerate) and replay.max_replays caps reuse, so the "
                "task may be out of the policy's reach or the reward function may return one value",
                step, self._idle_steps, int(float(metrics.get("buffer_groups", 0.0))),
                float(metrics.get("reward_mean", 0.0)))

    def log_heldout(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """Write one held-out point (``loop.heldout_eval``) as a record of its own: ``kind``
        ``heldout``, ``step`` = ``version`` = the trainer steps behind the scored weights (the
        training record of step v-1 reports that version), ``heldout/<benchmark>/avg@n`` and
        ``pass@k``. TensorBoard plots it at that step; W&B, whose steps only increase, at the
        latest step, against ``heldout/version``. Not part of ``history`` (training steps)."""
        version = int(point["version"])
        record = {"step": version, "kind": HELDOUT_KIND, "version": version, **point_metrics(point),
                  "wall_seconds": self._wall_offset + time.monotonic() - self._start}
        self.heldout.append(record)
        self._write_jsonl(record)
        if self._tb is not None:
            self._tb.write(version, {k: v for k, v in record.items() if k.startswith("heldout")})
        if self._wandb is not None:
            try:
                self._wandb.define_metric("heldout/*", step_metric="heldout/version")
                self._wandb.log({"heldout/version": version, **{k: v for k, v in record.items()
                                                                 if k.startswith("heldout/")}},
                                step=self._last_step)
            except Exception as exc:  # noqa: BLE001 (W&B never stops training)
                log.warning("W&B: held-out point of version %d not logged: %s", version, exc)
        log.info("held-out at version %d: %s", version, describe_point(record))
        return record

    @property
    def heldout_versions(self) -> list[int]:
        """Versions with a held-out point in ``metrics.jsonl`` (a resume does not score them again)."""
        return [int(r["version"]) for r in self.heldout]

    def _write_jsonl(self, record: Mapping[str, Any]) -> None:
        """The record to ``metrics.jsonl``; on a full disk it waits in memory (``metric_writers``)."""
        line = json.dumps(record)
        if self._file is None:
            try:
                self._file = self._open()
            except OSError as exc:  # the resume's rewrite: tried again at the next record
                self._unopened.append(line)
                self._open_outage.failed(exc)
                return
            self._open_outage.recovered(len(self._unopened))
            for waiting in self._unopened:
                self._file.pending.append((waiting + "\n").encode())
            self._unopened = []
        self._file.append_line(line)

    def _show(self, step: int, record: Mapping[str, Any]) -> None:
        """The bar and the log line; steps count from 1 as checkpoints do (``step_000001`` follows the
        first). A step that received no sample has no reward or staleness: it says so, never 0."""
        tok_s = record.get("trainer_tokens_per_s") or 0.0
        if record.get("samples_received"):
            reward, stale = f"{record.get('reward_mean') or 0:.3f}", f"{record.get('staleness_mean') or 0:.2f}"
        else:
            reward, stale = "-  (no new samples)", "-"
        self._bar.set_postfix(reward=reward, stale=stale, tok_s=f"{tok_s:.0f}", refresh=False)
        self._bar.update(1)
        if (step + 1) % self.cfg.log_interval == 0 and not self.cfg.progress_bar:
            log.info("%s step %d/%d reward %s staleness %s tokens/s %.0f", self.variant, step + 1,
                     self.cfg.steps, reward, stale, tok_s)

    def close(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Close writers; write ``progress.png`` (when ``cfg.plot``) and ``summary.json``. On a disk
        still full, what could not be written is said in one error line each; nothing raises."""
        try:
            self._bar.close()
        except OSError:
            pass
        if self._tb is not None and self._tb.close():
            log.error("%s: %d record(s) not written (no room)", self._tb.file.path, len(self._tb.file.pending))
        if self._wandb is not None:
            self._wandb.finish()
        summary = summarize(self.history, {**self.cfg.extra, **(extra or {})})
        if self.heldout:
            summary["heldout"] = [{k: v for k, v in r.items() if k == "version" or k.startswith("heldout")}
                                  for r in sorted(self.heldout, key=lambda r: r["version"])]
        summary_path = self.run_dir / "summary.json"
        if self._file is None and not self._unopened and summary_path.exists():  # no step made here
            return summary
        lost = self._file.close() if self._file is not None else len(self._unopened)
        if lost:
            log.error("%s: the last %d record(s) could not be written (no room); they are lost", self.path, lost)
        try:
            if self.cfg.plot and self.history:
                variant = (extra or {}).get("variant", "")
                title = f"variant {variant}, run dir {self.run_dir}" if variant else f"run dir {self.run_dir}"
                plot_progress(self.history, self.run_dir / "progress.png", title=title)
            summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        except OSError as exc:
            log.error("%s not written: %s", summary_path if self.history else self.run_dir, exc)
        return summary


def is_heldout(record: Mapping[str, Any]) -> bool:
    """A held-out point (``MetricsLogger.log_heldout``), not a training step."""
    return record.get("kind") == HELDOUT_KIND


def _kept(record: Mapping[str, Any], start_step: int) -> bool:
    """Whether a resume at ``start_step`` keeps ``record``: the steps before it, and the held-out
    points of the versions it restores (up to ``start_step``: the weights of the checkpoint)."""
    if is_heldout(record):
        return int(record["version"]) <= start_step
    return int(record["step"]) < start_step


def describe_point(record: Mapping[str, Any]) -> str:
    """``heldout 0.312 avg@1 (64 prompts)`` per benchmark, for the log and the run's last lines."""
    parts = []
    for key, value in record.items():
        bits = key.split("/")
        if len(bits) == 3 and bits[0] == "heldout" and bits[2].startswith("avg@") and value is not None:
            prompts = record.get(f"heldout/{bits[1]}/prompts")
            parts.append(f"{bits[1]} {value:.3f} {bits[2]}" + (f" ({prompts:.0f} prompts)" if prompts else ""))
    return ", ".join(parts) or "-"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, tolerating a cut-off last line.

    A kill in the middle of a write leaves a partial last line: it is dropped with a warning (its
    step is re-run and rewritten on resume). A bad line anywhere else is damage, not a kill:
    ``ValueError`` naming the file and line.
    """
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if any(rest.strip() for rest in lines[number:]):
                raise ValueError(f"{path}:{number}: not a JSON record ({exc.msg}); the file is damaged "
                                 "(only a cut-off last line is repaired)") from None
            log.warning("%s:%d: dropping a cut-off last record (%d bytes, a kill mid-write)",
                        path, number, len(line))
    return rows


def without_secret(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``run_config`` without the run's control-store secret (it never leaves the processes)."""
    out = json.loads(json.dumps(dict(run_config), default=str))
    control = out.get("transport", {}).get("control", {})
    if isinstance(control, dict) and "secret" in control:
        control["secret"] = ""
    return out


def summarize(history: list[Mapping[str, Any]], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``summary.json``: first/last reward (mean of a few steps, the window is stated) and totals."""
    rewards = [r.get("reward_mean") for r in history if r.get("samples_received")]
    rewards = [float(x) for x in rewards if x is not None]
    window = max(1, min(5, len(rewards) // 5))
    last = history[-1] if history else {}
    return {
        "reward_first": sum(rewards[:window]) / window if rewards else None,
        "reward_last": sum(rewards[-window:]) / window if rewards else None,
        "reward_window_steps": window,
        "steps": int(last["step"]) + 1 if history else 0,
        "samples_generated": int(last.get("samples_generated", 0)),
        "samples_trained": int(last.get("samples_trained", 0)),
        "wall_seconds": float(last.get("wall_seconds", 0.0)),
        **dict(extra or {}),
    }
