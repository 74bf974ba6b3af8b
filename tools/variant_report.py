"""Render ``variant_study`` records into docs/results.md tables and an accuracy-per-sample plot.

The record (``benchmarks/variant_study.py``) keeps every run's held-out curve and training
diagnostics, so the picture and the tables are redrawn from the JSON alone: per max staleness
one panel of test accuracy against samples consumed, mean over seeds with a band of one
standard deviation (sync drawn in every panel as the reference); a table of final accuracy,
samples to the target and realized staleness per case, with the difference to sync; and a
table of what the corrections did (weight ESS, capped-weight share, PPO clip fractions,
staleness of the selected samples). A record over several max stalenesses also gets the sweep:
final accuracy per case against max staleness, as a table (case x staleness) and a plot, sync's
band drawn across, which is the question the study asks (does staleness cost accuracy, and which
correction gives it back). The text between the markers of docs/results_log.md is replaced;
everything else in the file is left as written. The pictures go to ``img/`` beside the page
(docs/img/, where every picture of the docs lives).

The doc itself is the list of records it shows, in its order (newest study first, as written):
records named on the command line go first, then the ones the doc already shows, so adding a
study is one command and a plain rerun redraws the same page. ``--only`` shows the named ones
and nothing else (to drop a record or reorder).

    python tools/variant_report.py benchmarks/results/variant_study_NEW.json   # add one, keep the rest
    python tools/variant_report.py                                              # redraw the page
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.plot_async_speedup import mean_band  # noqa: E402

BEGIN, END = "<!-- variant_report:begin -->", "<!-- variant_report:end -->"
IMG = "img"  # the pictures' folder, beside the page
SAMPLED = 6  # the sampled accuracy's column of a run's ``curve`` (3: the study's metric, 5: greedy)


def _fmt(stat: dict | None, digits: int = 3) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    text = f"{stat['mean']:.{digits}f}"
    return text + (f" ± {stat['std']:.{digits}f}" if stat.get("n", 0) > 1 else "")


def _cases(record: dict) -> list[tuple[str, dict]]:
    return sorted(record["metrics"].items(), key=lambda kv: (kv[1]["max_staleness"], kv[0]))


def _run_mean(runs: list[dict], key: str) -> float | None:
    """Mean over runs of a run's mean over its training intervals (None-safe)."""
    per_run = []
    for r in runs:
        vals = [t[key] for t in r.get("train", []) if t.get(key) is not None]
        if vals:
            per_run.append(statistics.fmean(vals))
    return statistics.fmean(per_run) if per_run else None


def _spread(per_run: list[float | None]) -> dict:
    """Mean ± std over the runs with a value (None: the run has none), ``n`` of ``of`` runs."""
    values = [v for v in per_run if v is not None]
    return {"mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values), "of": len(per_run)}


# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t_interval(values: list[float | None]) -> dict:
    """Mean and two-sided 95% t-interval over the runs with a value: ``mean``, ``lo``, ``hi``,
    ``half`` (the half-width; None for fewer than two values), ``n`` of ``of``. Past 30 degrees of
    freedom the quantile is 1.96 + 2.4 / df (within 0.003 of the exact one)."""
    got = [v for v in values if v is not None]
    out = {"mean": statistics.fmean(got) if got else None, "lo": None, "hi": None, "half": None,
           "n": len(got), "of": len(values)}
    if len(got) > 1:
        df = len(got) - 1
        q = _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df
        half = q * statistics.stdev(got) / len(got) ** 0.5
        out.update(lo=out["mean"] - half, hi=out["mean"] + half, half=half)
    return out


def _fmt_ci(ci: dict, digits: int = 3, sign: str = "") -> str:
    """``mean [lo, hi]`` (the mean alone for one value); ``sign="+"`` for a difference."""
    if ci.get("mean") is None:
        return "-"
    text = f"{ci['mean']:{sign}.{digits}f}"
    return text + (f" [{ci['lo']:{sign}.{digits}f}, {ci['hi']:{sign}.{digits}f}]" if ci.get("half") is not None else "")


def case_name(m: dict) -> str:
    """The case as the tables name it: ``darl_keta`` (K = eta + 1) as ``darl_k<eta + 1>``."""
    return f"darl_k{m['max_staleness'] + 1}" if m["variant"] == "darl_keta" else m["variant"]


def sync_gain_target(record: dict, share: float = 0.75) -> float | None:
    """The accuracy at ``share`` of sync's mean gain (start to final): a target every record can
    reach, where the study's fixed ``--target`` may lie above every curve. None without a sync case
    that gained."""
    sync = record["metrics"].get("sync_eta0")
    if not sync or sync["final_accuracy"].get("mean") is None:
        return None
    start, final = sync["initial_accuracy"]["mean"], sync["final_accuracy"]["mean"]
    return start + share * (final - start) if final > start else None


def samples_to(m: dict, target: float) -> dict:
    """Samples consumed at each run's first evaluation at or above ``target`` (the study's metric,
    curve column 3), mean ± std over the runs that reached it, ``n`` of ``of`` runs."""
    return _spread([next((c[1] for c in r["curve"] if c[3] >= target), None) for r in m["runs"]])


def _pair_key(run: dict) -> tuple:
    """Runs that start alike: one seed from one warm-start fit (the records' GPU fits were not
    bitwise reproducible, so blocks of a seed on other machines started from other policies)."""
    return run.get("seed"), run.get("warmstart")


def _run_final(run: dict, column: int | None) -> float | None:
    """A run's final accuracy: the study's metric (``column`` None) or its last evaluation's
    ``curve`` column (6: sampled)."""
    if column is None:
        return run.get("final_accuracy")
    last = run["curve"][-1] if run.get("curve") else []
    return last[column] if len(last) > column else None


def paired_gap(m: dict, sync: dict | None, column: int | None = None) -> dict:
    """The case's final accuracy minus sync's, pair by pair (same seed, same warm start), and its
    95% t-interval: the pairs cancel what their start shares. A run without a sync run of its
    start is left out (``n`` of ``of`` says how many paired). ``column``: another accuracy of
    the curve (``_run_final``)."""
    if sync is None:
        return t_interval([])
    base = {_pair_key(r): v for r in sync["runs"] if (v := _run_final(r, column)) is not None}
    gaps = [(_pair_key(r), v) for r in m["runs"] if (v := _run_final(r, column)) is not None]
    return t_interval([v - base[key] if key in base else None for key, v in gaps])


def apart(gaps: list[dict]) -> str:
    """The page's rule for a difference: "below" ("above") when the paired 95% interval of every
    metric in ``gaps`` lies under (over) 0; "-" otherwise, an interval missing included (one pair
    has none)."""
    if not gaps or any(g.get("half") is None for g in gaps):
        return "-"
    if all(g["hi"] < 0 for g in gaps):
        return "below"
    return "above" if all(g["lo"] > 0 for g in gaps) else "-"


def _fmt_gap(ci: dict) -> str:
    """A paired gap, and how many runs paired when not all did."""
    text = _fmt_ci(ci, sign="+")
    return text + (f" ({ci['n']} of {ci['of']} paired)" if ci["mean"] is not None and ci["n"] < ci["of"] else "")


def accuracy_table(record: dict) -> str:
    """Per case: final accuracy with its 95% t-interval over seeds, the gap to sync paired by
    start (``paired_gap``: same seed and warm start), for a greedy record the same gap in the
    sampled accuracy and whether both put the case apart from sync (``apart``), samples to 3/4 of
    sync's gain and realized staleness (the headline columns), then the rest.

    Two targets: 3/4 of sync's gain (``sync_gain_target``: sync's mean initial accuracy plus 3/4
    of its mean gain), the sample-efficiency measure that reads on any record, and the study's
    ``--target`` (its column only when some run reached it)."""
    sync = record["metrics"].get("sync_eta0")
    fixed = record["config"].get("target")
    relative = sync_gain_target(record)
    show_fixed = any(m["samples_to_target"]["n"] for m in record["metrics"].values())
    show_k = any("window_k" in m for m in record["metrics"].values())
    sampled = SAMPLED if record["config"].get("metric", "greedy") == "greedy" and record["config"].get(
        "eval_samples") else None  # the second metric a difference must show in
    head = ["case", "max staleness", *(["K"] if show_k else []), "seeds", "test acc. start",
            "test acc. final [95% CI]", "vs sync, paired by start [95% CI]"]
    head += ["sampled vs sync, paired [95% CI]", "apart from sync (both)"] if sampled is not None else []
    head += [f"samples to {relative:.3f} (3/4 of sync's gain)", "reached"] if relative is not None else []
    head += [f"samples to {fixed}", "reached"] if show_fixed else []
    show_b = any((m.get("groups_trained_per_step") or {}).get("n") for m in record["metrics"].values())
    head += ["realized staleness", *(["groups trained / step"] if show_b else []), "train reward (last 10%)", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in _cases(record):
        final = t_interval([r["final_accuracy"] for r in m["runs"]])
        gaps = [] if m["variant"] == "sync" else [paired_gap(m, sync), *(
            [paired_gap(m, sync, sampled)] if sampled is not None else [])]
        row = [case_name(m), str(m["max_staleness"]), *([str(m.get("window_k", "-"))] if show_k else []),
               _seeds(m["runs"]), _fmt(m["initial_accuracy"]), _fmt_ci(final)]
        if gaps:
            row += [*(_fmt_gap(g) for g in gaps), *([apart(gaps)] if sampled is not None else [])]
        else:  # sync itself
            row += ["-"] * (3 if sampled is not None else 1)
        reaches = ([samples_to(m, relative)] if relative is not None else []) + (
            [m["samples_to_target"]] if show_fixed else [])
        for reach in reaches:
            row += [_fmt(reach, 0), f"{reach['n']}/{reach['of']}"]
        row += [_fmt(m["staleness_mean"], 2), *([_fmt(m.get("groups_trained_per_step"), 1)] if show_b else []),
                _fmt(m["train_reward_last"]), _fmt(m["wall_seconds"], 0)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _seeds(runs: list[dict]) -> str:
    """How many seeds a case's runs cover, and how many runs when a seed has two (its blocks ran
    from two warm-start fits, each with its own sync run)."""
    seeds = len({r.get("seed", i) for i, r in enumerate(runs)})
    return str(seeds) if seeds == len(runs) else f"{seeds} ({len(runs)} runs)"


def _etas(record: dict) -> list[int]:
    return sorted({m["max_staleness"] for m in record["metrics"].values() if m["max_staleness"] > 0})


def _final(m: dict, column: int) -> dict:
    """Mean ± std over a case's seeds of its last evaluation's ``curve`` column (3: the study's
    metric, 5: greedy, 6: sampled)."""
    return _spread([r["curve"][-1][column] if len(r["curve"][-1]) > column else None for r in m["runs"]])


def sweep_table(record: dict, column: int = 3) -> str:
    """Final accuracy (mean ± std over seeds; ``curve`` column ``column``) of every case at every
    max staleness; sync's row repeats its eta-0 value in every column, the reference each cell is
    read against."""
    etas, by_case = _etas(record), {}
    for m in record["metrics"].values():
        by_case.setdefault(m["variant"], {})[m["max_staleness"]] = _final(m, column)
    sync = by_case.pop("sync", {}).get(0)
    head = ["case", *(f"max staleness {e}" for e in etas)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if sync is not None:
        lines.append("| " + " | ".join(["sync (eta 0)", *(_fmt(sync) for _ in etas)]) + " |")
    order = _case_order(record)
    for case, finals in sorted(by_case.items(), key=lambda kv: order[kv[0]]):
        label = "darl_keta (K = eta + 1)" if case == "darl_keta" else case
        lines.append("| " + " | ".join([label, *(_fmt(finals.get(e)) for e in etas)]) + " |")
    return "\n".join(lines) + "\n"


def _case_order(record: dict) -> dict[str, int]:
    """The study's own order of its cases: it writes its metrics by max staleness, then in its
    case order, so each case's first appearance at the lowest staleness gives it (no import of
    the study)."""
    order: dict[str, int] = {}
    for m in sorted(record["metrics"].values(), key=lambda m: m["max_staleness"]):
        order.setdefault(m["variant"], len(order))
    return order


def diagnostics_table(record: dict) -> str:
    """What the corrections did, averaged over training and seeds."""
    head = ["case", "max staleness", "selected staleness", "selected versions (share by age 0, 1, ...)",
            "weight ESS", "capped weights", "capped A > 0", "capped A < 0", "mean weight A > 0",
            "mean weight A < 0", "PPO clip low", "PPO clip high", "selected score"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, m in _cases(record):
        runs = m["runs"]
        hist: list[float] = []
        for r in runs:
            for t in r.get("train", []):
                for i, v in enumerate(t.get("selected_hist") or []):
                    hist += [0.0] * (i + 1 - len(hist))
                    hist[i] += v
        total = sum(hist)
        shares = " ".join(f"{v / total:.2f}" for v in hist) if total else "-"
        cells = [_run_mean(runs, k) for k in (
            "selected_mean", "weight_ess", "weight_clip_frac", "weight_clip_frac_pos", "weight_clip_frac_neg",
            "weight_mean_pos", "weight_mean_neg", "clip_frac_low", "clip_frac_high", "selected_score_mean")]
        lines.append("| " + " | ".join([case_name(m), str(m["max_staleness"]), *(
            "-" if c is None else f"{c:.3g}" for c in cells[:1]), shares, *(
            "-" if c is None else f"{c:.3g}" for c in cells[1:])]) + " |")
    return "\n".join(lines) + "\n"


def plot(record: dict, out: Path) -> Path:
    """One panel per max staleness: test accuracy vs samples, mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 (the axis formatter)

    etas = sorted({m["max_staleness"] for m in record["metrics"].values() if m["max_staleness"] > 0}) or [0]
    # one panel gets the width of the title (device, size, data) too, which 4.5 in cut off
    fig, axes = plt.subplots(1, len(etas), figsize=(max(6.0, 4.5 * len(etas)), 4), sharey=True,
                             squeeze=False)
    target, top = record["config"].get("target"), 0.0
    for ax, eta in zip(axes[0], etas):
        for name, m in _cases(record):
            if m["max_staleness"] not in (0, eta):
                continue
            curves = [([c[1] for c in r["curve"]], [c[3] for c in r["curve"]]) for r in m["runs"]]
            grid, mean, std = mean_band(curves, points=40)
            style = {"color": "black", "linestyle": "--"} if m["variant"] == "sync" else {}
            (line,) = ax.plot(grid, mean, label=f"{case_name(m)} (n={len(curves)})", **style)
            ax.fill_between(grid, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                            alpha=0.15, color=line.get_color())  # the band in its line's colour
            top = max([top, *(a + b for a, b in zip(mean, std))])
        ax.set_title(f"max staleness {eta}")
        ax.set_xlabel("samples consumed (steps x B x G)")  # curve[1]; every case consumes the same
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:g}k"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    for ax in axes[0]:  # a target far above every curve would flatten them: named, not drawn
        if target is not None and target <= 1.5 * top:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        elif target is not None:
            ax.text(0.98, 0.02, f"target {target:g}: above the plot", transform=ax.transAxes, ha="right",
                    va="bottom", fontsize="x-small", color="grey")
    axes[0][0].set_ylabel("held-out test accuracy")
    cfg = record["config"]
    fig.suptitle(f"variant_study: {record['device']}, {cfg.get('size')} policy, data={cfg.get('data')}\n"
                 f"lr {cfg.get('lr')}, M={cfg.get('minibatches')}, commit {record['commit'][:7]}",
                 fontsize="medium")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_sweep(record: dict, out: Path) -> Path:
    """Final accuracy against max staleness, one line per case (mean ± std over seeds), sync's
    eta-0 mean and band across the axis; a second panel with the sampled accuracy when the record
    has it (less test noise than greedy's one response per prompt)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas, cfg = _etas(record), record["config"]
    panels = [(3, cfg.get("metric", "greedy"))]
    if cfg.get("metric", "greedy") == "greedy" and cfg.get("eval_samples"):
        panels.append((6, f"sampled ({cfg['eval_samples']} per prompt)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    cases = [c for c in _case_order(record) if c != "sync"]
    for ax, (column, name) in zip(axes[0], panels):
        sync = _final(record["metrics"]["sync_eta0"], column) if "sync_eta0" in record["metrics"] else None
        if sync is not None and sync["mean"] is not None:
            ax.axhline(sync["mean"], color="black", linestyle="--", label=f"sync (eta 0, n={sync['n']})")
            ax.axhspan(sync["mean"] - sync["std"], sync["mean"] + sync["std"], color="black", alpha=0.08)
        for i, case in enumerate(cases):
            dodge = (i - (len(cases) - 1) / 2) * 0.05  # cases side by side at each staleness
            pts = sorted((m["max_staleness"], _final(m, column)) for m in record["metrics"].values()
                         if m["variant"] == case)
            pts = [(e, f) for e, f in pts if f["mean"] is not None]
            ax.errorbar([etas.index(e) + dodge for e, _ in pts], [f["mean"] for _, f in pts],
                        yerr=[f["std"] for _, f in pts], marker="o", capsize=3, label=case)
        ax.set_xticks(range(len(etas)), [str(e) for e in etas])
        ax.set_xlabel("max staleness (eta)")
        ax.set_ylabel(f"final held-out accuracy, {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle(f"{record['device']}, {cfg.get('size')} policy, commit {record['commit'][:7]}", fontsize="medium")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def section(record: dict, record_path: Path, image: Path, doc: Path) -> str:
    """The generated markdown of one record: settings, plot, both tables."""
    cfg = record["config"]
    rel = image.relative_to(doc.parent) if image.is_relative_to(doc.parent) else image
    keys = ("steps", "groups", "group_size", "minibatches", "lr", "rollout_batch", "data", "data_overrides",
            "size", "eval_every", "test_prompts", "overrides")  # overrides: extra Hydra ones of every run
    settings = ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg and (cfg[k] or k != "overrides"))
    return (f"### `{record_path.name}` ({record['device']}, {record['date'][:16]}, commit {record['commit'][:7]})\n\n"
            f"Settings: {settings}; {cfg.get('samples_per_run')} samples per run.\n\n"
            + (f"Note: {cfg['note']}.\n\n" if cfg.get("note") else "")
            + (f"Not finished, so not in the record: {', '.join(cfg['left_out'])}.\n\n"
               if cfg.get("left_out") else "")
            + sweep(record, record_path, doc)
            + f"![variant_study]({rel})\n\n{accuracy_table(record)}\n{diagnostics_table(record)}")


def sweep(record: dict, record_path: Path, doc: Path) -> str:
    """The sweep's table and plot, for a record over two or more max stalenesses ("" otherwise)."""
    if len(_etas(record)) < 2:
        return ""
    image = plot_sweep(record, doc.parent / IMG / f"{record_path.stem}_sweep.png")
    rel = image.relative_to(doc.parent) if image.is_relative_to(doc.parent) else image
    metric = record["config"].get("metric", "greedy")
    text = (f"Final held-out accuracy ({metric}) against max staleness (mean ± std over seeds):\n\n"
            f"{sweep_table(record)}\n")
    samples = record["config"].get("eval_samples")
    if metric == "greedy" and samples:  # less test noise: samples x prompts responses per point
        text += (f"The same with the sampled accuracy ({samples} responses per test prompt at temperature "
                 f"{record['config'].get('eval_temperature')}):\n\n{sweep_table(record, 6)}\n")
    return text + f"![variant_study sweep]({rel})\n\n"


def render(records: list[Path], doc: Path) -> str:
    """Replace the generated part of ``doc`` with one section per record; return the new text."""
    parts = []
    for path in records:
        record = json.loads(path.read_text())
        if record.get("benchmark") != "variant_study":
            raise SystemExit(f"{path}: not a variant_study record ({record.get('benchmark')!r})")
        image = plot(record, doc.parent / IMG / f"{path.stem}.png")
        parts.append(section(record, path, image, doc))
    body = f"{BEGIN}\n<!-- generated by tools/variant_report.py from the records; do not edit -->\n\n" \
           + "\n".join(parts) + f"\n{END}"
    text = doc.read_text() if doc.exists() else f"# Results\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers to replace")
    head, rest = text.split(BEGIN, 1)
    return head + body + rest.split(END, 1)[1]


def shown(doc: Path, results: Path) -> list[Path]:
    """The records the generated part of ``doc`` shows, in its order, as paths under ``results``;
    one that is no longer there is an error naming it (the page would silently lose it)."""
    if not doc.exists() or BEGIN not in (text := doc.read_text()):
        return []
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    paths = [results / name for name in re.findall(r"^### `(variant_study_[^`]+\.json)`", block, re.M)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"{doc} shows records that {results} does not hold: {', '.join(missing)} "
                         "(restore them, or name the records to keep with --only)")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", type=Path, help="records to show first (default: none)")
    parser.add_argument("--doc", type=Path, default=Path("docs/results_log.md"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"),
                        help="where the records the doc already shows are")
    parser.add_argument("--only", action="store_true", help="show the named records and no others")
    args = parser.parse_args(argv)
    records = list(args.records)
    if not args.only:
        named = {p.name for p in records}
        records += [p for p in shown(args.doc, args.results) if p.name not in named]
    if not records:
        parser.error(f"no records named and {args.doc} shows none")
    args.doc.write_text(render(records, args.doc))
    print(args.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
