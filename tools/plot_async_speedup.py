"""Draw an ``async_speedup`` record: reward against samples and against wall seconds per variant.

The record (``benchmarks/async_speedup.py``) keeps every run's curve, so the picture in
docs/benchmarks.md is redrawn from the JSON alone: the mean over seeds with a band of one
standard deviation (seconds counted from each run's first step, as samples/s is), per variant and cluster, on a common grid of samples (left) and seconds
(right). Sample efficiency reads off the left panel, wall-clock speed off the right.

    python tools/plot_async_speedup.py benchmarks/results/async_speedup_*.json --out docs/img/async_speedup.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _interp(xs: list[float], ys: list[float], x: float) -> float | None:
    """Linear interpolation of a monotone curve; None outside its range."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            span = xs[i] - xs[i - 1]
            w = 0.0 if span == 0 else (x - xs[i - 1]) / span
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


def mean_band(curves: list[tuple[list[float], list[float]]], points: int = 60):
    """Grid up to the shortest curve; mean and std of the curves on it."""
    end = min(c[0][-1] for c in curves)
    start = max(c[0][0] for c in curves)
    grid = [min(end, start + (end - start) * i / (points - 1)) for i in range(points)]
    means, stds = [], []
    for x in grid:
        vals = [v for v in (_interp(cx, cy, x) for cx, cy in curves) if v is not None]
        means.append(statistics.fmean(vals))
        stds.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return grid, means, stds


def plot(record: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for case, m in sorted(record["metrics"].items()):
        runs = m.get("runs") or []
        if not runs or any("curve" not in r for r in runs):
            raise SystemExit(f"{case}: the record has no per-run curves (made before they were kept)")
        for ax, col in ((axes[0], 0), (axes[1], 1)):
            # seconds count from the run's first step, as samples/s does (start-up left out)
            curves = [([p[col] - (r["curve"][0][1] if col else 0.0) for p in r["curve"]],
                       [p[2] for p in r["curve"]]) for r in runs]
            grid, mean, std = mean_band(curves)
            ax.plot(grid, mean, label=f"{case} (n={len(runs)})")
            ax.fill_between(grid, [a - b for a, b in zip(mean, std)],
                            [a + b for a, b in zip(mean, std)], alpha=0.2)
    target = record["config"].get("target")
    for ax in axes:
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].set_xlabel("samples generated")
    axes[1].set_xlabel("wall seconds since the first step")
    axes[0].set_ylabel("reward (mean of the step's generated groups)")
    axes[0].legend(fontsize="small")
    fig.suptitle(f"async_speedup: {record['device']}, {record['config'].get('size')} policy, "
                 f"commit {record['commit'][:7]}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/img/async_speedup.png"))
    args = parser.parse_args()
    print(plot(json.loads(args.record.read_text()), args.out))


if __name__ == "__main__":
    main()
