"""The end-of-run picture: reward, staleness and selected versions over steps, from metrics.jsonl.

Kept apart from the logger so matplotlib (Agg, no display) is imported only when a plot is
written, and so ``tools/`` can redraw a plot from any run's ``metrics.jsonl``. Drawn for a reader
who has not read the code: a title naming the variant and the run, the per-step reward faint
under its moving average (one step's mean over a few groups is noisy), axis labels in words, and
every legend beside its panel rather than on top of the data. Steps are numbered from 1, as the
log and the checkpoints count them; a step that received no new sample has no reward and no
arriving age, so it is marked as such on the reward panel, never drawn as a reward of 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start, so no step is dropped)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def has_new_samples(record: Mapping[str, Any]) -> bool:
    """Whether the step received samples (records without the count are taken to have)."""
    return bool(record.get("samples_received", 1))


def plot_progress(history: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Write ``progress_figure(history, title)`` to ``path`` (PNG); returns ``path``."""
    import matplotlib.pyplot as plt

    fig = progress_figure(history, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def progress_figure(history: Sequence[Mapping[str, Any]], title: str = ""):
    """Three panels over trainer steps: reward, the age of the data, the trained groups by age."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) + 1 for r in history]  # step N publishes weight version N
    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True, layout="constrained")
    fig.suptitle(title or "training progress")
    outside = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small"}

    fed = [i for i, r in enumerate(history) if has_new_samples(r)]
    fed_steps = [steps[i] for i in fed]
    reward = [history[i].get("reward_mean") or 0.0 for i in fed]
    window = max(1, min(10, len(reward) // 5))
    axes[0].plot(fed_steps, reward, color="tab:blue", alpha=0.3, linewidth=1, label="each step")
    axes[0].plot(fed_steps, moving_average(reward, window), color="tab:blue", linewidth=2,
                 label=f"mean of {window} steps" if window > 1 else "mean")
    empty = sorted(set(steps) - set(fed_steps))
    if empty:
        axes[0].plot(empty, [min(reward, default=0.0)] * len(empty), linestyle="none", marker="x",
                     color="tab:gray", label="no new samples")
    axes[0].set_ylabel("reward of the\ngenerated samples")
    axes[0].legend(**outside)

    axes[1].plot(fed_steps, [history[i].get("staleness_mean") or 0.0 for i in fed], marker=".",
                 label="arriving samples")
    trained = [i for i, r in enumerate(history) if r.get("samples_selected", 1)]
    axes[1].plot([steps[i] for i in trained], [history[i].get("selected_mean") or 0.0 for i in trained],
                 marker=".", label="trained samples")
    axes[1].set_ylabel("age of the data\n(versions behind)")
    axes[1].legend(**outside)

    hists = [r.get("selected_hist") or [0.0] for r in history]
    bins = max(len(h) for h in hists)
    bottom = [0.0] * len(steps)
    for b in range(bins):
        heights = [h[b] if b < len(h) else 0.0 for h in hists]
        label = "current version" if b == 0 else f"{b} behind" + (" or more" if b == bins - 1 else "")
        axes[2].bar(steps, heights, bottom=bottom, width=0.9, label=label)
        bottom = [x + y for x, y in zip(bottom, heights)]
    axes[2].set_ylabel("groups trained,\nby age")
    axes[2].set_xlabel("trainer step (step N publishes weight version N)")
    axes[2].legend(**outside)
    return fig
