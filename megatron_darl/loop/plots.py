"""The end-of-run picture: reward, staleness and selected versions over steps, from metrics.jsonl.

Kept apart from the logger so matplotlib (Agg, no display) is imported only when a plot is
written, and so ``tools/`` can redraw a plot from any run's ``metrics.jsonl``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence


def plot_progress(history: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Three panels: mean reward, mean arrival staleness, selected-staleness histogram per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in history]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(steps, [r.get("reward_mean") or 0.0 for r in history], marker=".")
    axes[0].set_ylabel("reward (generated)")
    axes[1].plot(steps, [r.get("staleness_mean") or 0.0 for r in history], marker=".",
                 label="arrivals")
    axes[1].plot(steps, [r.get("selected_mean") or 0.0 for r in history], marker=".",
                 label="selected")
    axes[1].set_ylabel("staleness t - v")
    axes[1].legend(loc="upper left")
    hists = [r.get("selected_hist") or [0.0] for r in history]
    bins = max(len(h) for h in hists)
    bottom = [0.0] * len(steps)
    for b in range(bins):
        heights = [h[b] if b < len(h) else 0.0 for h in hists]
        axes[2].bar(steps, heights, bottom=bottom, width=0.9, label=f"t-{b}" if b else "t")
        bottom = [x + y for x, y in zip(bottom, heights)]
    axes[2].set_ylabel("selected groups by version")
    axes[2].set_xlabel("step")
    axes[2].legend(loc="upper left", ncol=min(bins, 6), fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
