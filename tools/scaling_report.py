"""Scaling-study report: the same experiment at several node counts, as a table and plots.

    python tools/scaling_report.py RUN_DIR [RUN_DIR ...] --out DIR [--skip-steps 1]
    python tools/scaling_report.py --records benchmarks/results --out docs/img

The second form reports ``benchmarks/loop_profile.py`` records by trainer:rollout split and batch
shape instead (``tools/scaling_records.py``): one markdown table (the production engines' darl and
decoupled rows, each with its samples/s over the 1:1 split's and darl's step over decoupled's;
then the ``hf`` rows, a regression guard) and one plot, ``loop_profile.png``, for docs/benchmarks.md.

Each RUN_DIR is a run's ``loop.run_dir`` (``slurm/scaling_study.sh`` makes one per node count):
``metrics.jsonl`` (one record per step, written by the training loop), ``summary.json`` (its
``nodes`` tag comes from ``slurm/launch.sh``) and ``run_config.yaml``. Per run it averages the
steady-state steps (the first ``--skip-steps`` are warm-up: compilation, first weight sync) and
writes to DIR: ``scaling.md`` (markdown table: samples trained and tokens per second, and a
warning for a run that trained nothing), ``scaling.json`` (the same rows),
``throughput.png``, ``efficiency.png`` (vs the smallest run: (X_N / X_0) / (N / N_0), 1.0 is
linear) and ``step_breakdown.png`` (waiting for samples, weight sync, the rest). A run whose
files are missing or malformed stops the report with one line naming the file (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

REQUIRED = ("step", "step_seconds", "receive_wait_seconds", "weight_sync_seconds",
            "trainer_tokens_per_s", "rollout_tokens_per_s")


class ReportError(ValueError):
    """A run directory that cannot be reported; the message names the file."""


@dataclass
class RunRow:
    """One run's steady-state averages (seconds per step, tokens per second)."""

    run: str  # run directory name
    nodes: int  # nodes of the allocation
    trainer_ranks: Optional[int]  # Megatron ranks (run_config.yaml)
    rollout_workers: Optional[int]  # rollout engines
    steps: int  # steady-state steps averaged
    step_s: float  # wall seconds per optimizer step
    receive_wait_s: float  # of which waiting for sample groups
    weight_sync_s: float  # of which publishing weights to the engines
    trainer_tokens_per_s: float  # tokens trained per second of train step
    e2e_tokens_per_s: float  # response tokens received per wall second (the pipeline's rate)
    samples_per_s: Optional[float]  # samples trained per wall second (None: the metrics lack samples_selected)
    mfu: Optional[float]  # trainer model FLOPs utilisation (None on CPU runs that lack it)
    efficiency_e2e: float = 1.0  # scaling efficiency of e2e_tokens_per_s vs the smallest run
    efficiency_trainer: float = 1.0  # same for trainer_tokens_per_s

    @property
    def other_s(self) -> float:
        return max(self.step_s - self.receive_wait_s - self.weight_sync_s, 0.0)


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReportError(f"{path}: missing (did the run finish? the loop writes it at the end)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object")
    return data


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl``, checked for the fields this report uses."""
    if not path.is_file():
        raise ReportError(f"{path}: missing (no step of this run was logged)")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(f"{path} line {lineno}: not valid JSON ({err.msg})") from None
        if row.get("kind") == "heldout":  # a held-out point (eval.*), not a step
            continue
        missing = [k for k in REQUIRED if not isinstance(row.get(k), (int, float))]
        if missing:
            raise ReportError(f"{path} line {lineno}: no numeric {', '.join(missing)}")
        rows.append(row)
    if not rows:
        raise ReportError(f"{path}: no step records")
    return rows


def _run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "run_config.yaml"
    if not path.is_file():
        return {}
    import yaml

    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ReportError(f"{path}: not valid YAML ({err})") from None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_run(run_dir: Path, skip_steps: int = 1) -> RunRow:
    """Steady-state averages of one run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    summary = _load_json(run_dir / "summary.json")
    rows = read_metrics(run_dir / "metrics.jsonl")
    cfg = _run_config(run_dir)
    nodes = summary.get("nodes", cfg.get("loop", {}).get("extra", {}).get("nodes"))
    if not isinstance(nodes, int) or nodes < 1:
        raise ReportError(f"{run_dir / 'summary.json'}: no 'nodes' (runs of slurm/launch.sh record it)")
    steady = rows[skip_steps:] if len(rows) > skip_steps else rows
    secs = [float(r["step_seconds"]) for r in steady]
    tokens = sum(float(r["rollout_tokens_per_s"]) * float(r["step_seconds"]) for r in steady)
    trained = [float(r["samples_selected"]) for r in steady if isinstance(r.get("samples_selected"), (int, float))]
    mfus = [float(r["mfu"]) for r in steady if isinstance(r.get("mfu"), (int, float))]
    cluster = cfg.get("cluster", {})
    return RunRow(
        run=run_dir.name, nodes=nodes, trainer_ranks=cluster.get("trainer_ranks"),
        rollout_workers=cluster.get("rollout_workers"), steps=len(steady), step_s=_mean(secs),
        receive_wait_s=_mean([float(r["receive_wait_seconds"]) for r in steady]),
        weight_sync_s=_mean([float(r["weight_sync_seconds"]) for r in steady]),
        trainer_tokens_per_s=_mean([float(r["trainer_tokens_per_s"]) for r in steady]),
        e2e_tokens_per_s=tokens / sum(secs) if sum(secs) > 0 else 0.0,
        samples_per_s=sum(trained) / sum(secs) if len(trained) == len(steady) and sum(secs) > 0 else None,
        mfu=_mean(mfus) if mfus else None,
    )


def add_efficiency(rows: list[RunRow]) -> list[RunRow]:
    """Sort by nodes and fill the efficiencies relative to the smallest run."""
    rows = sorted(rows, key=lambda r: (r.nodes, r.run))
    base = rows[0]
    for r in rows:
        scale = r.nodes / base.nodes
        r.efficiency_e2e = (r.e2e_tokens_per_s / base.e2e_tokens_per_s / scale) if base.e2e_tokens_per_s else 0.0
        r.efficiency_trainer = (r.trainer_tokens_per_s / base.trainer_tokens_per_s / scale
                                if base.trainer_tokens_per_s else 0.0)
    return rows


def markdown_table(rows: list[RunRow]) -> str:
    head = ("| run | nodes | trainer ranks | rollout workers | steps | step s | receive wait s | "
            "weight sync s | other s | samples/s | trainer tok/s | e2e tok/s | MFU | efficiency e2e | "
            "efficiency trainer |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        mfu = f"{r.mfu:.3g}" if r.mfu is not None else "-"
        samples = f"{r.samples_per_s:.1f}" if r.samples_per_s is not None else "-"
        lines.append(
            f"| {r.run} | {r.nodes} | {r.trainer_ranks if r.trainer_ranks is not None else '-'} | "
            f"{r.rollout_workers if r.rollout_workers is not None else '-'} | {r.steps} | {r.step_s:.3f} | "
            f"{r.receive_wait_s:.3f} | {r.weight_sync_s:.3f} | {r.other_s:.3f} | {samples} | "
            f"{r.trainer_tokens_per_s:.0f} | {r.e2e_tokens_per_s:.0f} | {mfu} | "
            f"{r.efficiency_e2e:.2f} | {r.efficiency_trainer:.2f} |")
    return "\n".join(lines)


def untrained_warnings(rows: list[RunRow]) -> list[str]:
    """One line per run whose steady steps trained no sample: its trainer figures measure nothing.
    A policy that earns no reward (a random init) makes every group degenerate, and
    ``replay.drop_degenerate`` (on by default) drops them all."""
    return [f"{r.run}: its {r.steps} steady steps trained no sample (every group degenerate and dropped? "
            f"replay.drop_degenerate=false keeps them), so its trainer figures measure nothing"
            for r in rows if r.samples_per_s == 0.0]


def plot(rows: list[RunRow], out: Path) -> list[Path]:
    """The three PNGs: throughput vs nodes, efficiency vs nodes, step-time breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [r.nodes for r in rows]
    base = rows[0]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for attr, label in (("e2e_tokens_per_s", "end-to-end (generated, received)"),
                        ("trainer_tokens_per_s", "trainer step")):
        values = [getattr(r, attr) for r in rows]
        ax.plot(nodes, values, marker="o", label=label)
        ax.plot(nodes, [getattr(base, attr) * n / base.nodes for n in nodes], linestyle=":",
                color=ax.lines[-1].get_color(), label=f"{label}, linear")
    ax.set(xlabel="nodes", ylabel="tokens / s", title="throughput", xticks=sorted(set(nodes)))
    ax.legend(fontsize="small")
    paths.append(_save(fig, out / "throughput.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(nodes, [r.efficiency_e2e for r in rows], marker="o", label="end-to-end")
    ax.plot(nodes, [r.efficiency_trainer for r in rows], marker="s", label="trainer step")
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.set(xlabel="nodes", ylabel=f"efficiency vs {base.nodes} node(s)", title="scaling efficiency",
           xticks=sorted(set(nodes)))
    ax.legend(fontsize="small")
    paths.append(_save(fig, out / "efficiency.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{r.nodes}n\n{r.run}" for r in rows]
    bottom = [0.0] * len(rows)
    for attr, label in (("receive_wait_s", "waiting for samples"), ("weight_sync_s", "weight sync"),
                        ("other_s", "log-probs, selection, train")):
        heights = [getattr(r, attr) for r in rows]
        ax.bar(labels, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set(ylabel="seconds per step", title="step-time breakdown")
    ax.legend(fontsize="small")
    paths.append(_save(fig, out / "step_breakdown.png"))
    plt.close("all")
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def build_report(run_dirs: Sequence[Path], out: Path, skip_steps: int = 1) -> list[RunRow]:
    """Read every run (all errors before any output), then write the table, JSON and plots."""
    if not run_dirs:
        raise ReportError("no run directories given")
    rows = add_efficiency([summarize_run(Path(d), skip_steps) for d in run_dirs])
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows)
    images = plot(rows, out)
    md = [f"# Scaling study ({len(rows)} runs, steady state: steps after the first {skip_steps})", "",
          table, "", "efficiency = (X_N / X_0) / (N / N_0) against the smallest run; e2e tok/s = "
          "response tokens received per wall second of the loop; samples/s = samples trained per wall second.", ""]
    warnings = untrained_warnings(rows)
    md += [f"**{line}**" for line in warnings] + ([""] if warnings else [])
    md += [f"![{p.stem}]({p.name})" for p in images]
    (out / "scaling.md").write_text("\n".join(md) + "\n")
    (out / "scaling.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scaling_report", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories (loop.run_dir)")
    parser.add_argument("--records", type=Path, default=None,
                        help="a results dir: report its loop_profile records by GPU split instead")
    parser.add_argument("--out", type=Path, required=True,
                        help="directory for scaling.md and the plots (--records: docs/img)")
    parser.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out of the averages")
    args = parser.parse_args(argv)
    if args.records is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tools.scaling_records import report

        try:
            print(report(args.records, args.out))
        except (ValueError, KeyError) as err:
            print(f"scaling_report: error: {err}", file=sys.stderr)
            return 1
        print(f"wrote {args.out / 'loop_profile.png'}")
        return 0
    try:
        rows = build_report(args.runs, args.out, max(args.skip_steps, 0))
    except ReportError as err:
        print(f"scaling_report: error: {err}", file=sys.stderr)
        return 1
    print(markdown_table(rows))
    for line in untrained_warnings(rows):
        print(f"scaling_report: warning: {line}", file=sys.stderr)
    print(f"wrote {args.out / 'scaling.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
