"""The loop's scaling by GPU count and split, from ``benchmarks/loop_profile.py`` records.

``python tools/scaling_report.py --records benchmarks/results --out docs/img`` (this module does the
work): per device, engine (hf, vllm) and variant, the newest record of each trainer:rollout split;
a markdown table (samples/s, step time, the speedup over the 1:1 split of the same device and
engine measured in the same call, i.e. the same commit, and where the step goes) and one picture,
``loop_profile.png``, which ``tools/benchmarks_table.py`` shows under the loop_profile table of
docs/benchmarks.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(results: Path) -> list[dict[str, Any]]:
    """The newest loop_profile record per (device, engine, variant, split) that names its split."""
    newest: dict[tuple, dict] = {}
    for path in sorted(results.glob("loop_profile_*.json")):
        r = json.loads(path.read_text())
        c = r["config"]
        if not c.get("trainer_gpus"):
            continue  # records from before GPU counts (gpu1/gpu2 layouts)
        key = (r["device"], c.get("engine", "hf"), c.get("variant"), c["trainer_gpus"], c["rollout_gpus"])
        if key not in newest or r["date"] > newest[key]["date"]:
            newest[key] = r
    return sorted(newest.values(), key=lambda r: (r["device"], r["config"].get("engine", "hf"),
                                                  r["config"]["trainer_gpus"] + r["config"]["rollout_gpus"]))


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per record, with its speedup over the 1:1 record of the same call."""
    base = {(r["device"], r["config"].get("engine", "hf"), r["commit"]): r for r in records
            if (r["config"]["trainer_gpus"], r["config"]["rollout_gpus"]) == (1, 1)}
    out = []
    for r in records:
        c, m = r["config"], r["metrics"]
        one = base.get((r["device"], c.get("engine", "hf"), r["commit"]))
        out.append({
            "device": r["device"], "engine": c.get("engine", "hf"), "variant": c.get("variant"),
            "split": f"{c['trainer_gpus']}:{c['rollout_gpus']}", "gpus": c["trainer_gpus"] + c["rollout_gpus"],
            "samples_per_s": m["samples_per_s"], "step_seconds": m["step_seconds"],
            "speedup": m["samples_per_s"] / one["metrics"]["samples_per_s"] if one else None,
            "receive_wait_seconds": m.get("receive_wait_seconds"), "generation_seconds": m.get("generation_seconds"),
            "trainer_seconds": sum(m.get(k) or 0.0 for k in ("logprob_seconds", "plan_seconds",
                                                             "backfill_seconds", "train_seconds")),
            "date": r["date"][:10], "commit": str(r["commit"])[:8]})
    return out


def table(data: list[dict[str, Any]]) -> str:
    head = ["device", "engine", "variant", "split (trainer:rollout GPUs)", "samples/s", "step s",
            "vs 1:1", "trainer idle s", "generation s/worker", "trainer work s", "date", "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in data:
        speed = f"{d['speedup']:.2f}x" if d["speedup"] else "-"
        lines.append(f"| {d['device']} | {d['engine']} | {d['variant']} | {d['split']} | {d['samples_per_s']:.1f} | "
                     f"{d['step_seconds']:.2f} | {speed} | {d['receive_wait_seconds'] or 0:.2f} | "
                     f"{d['generation_seconds'] or 0:.2f} | {d['trainer_seconds']:.2f} | {d['date']} | {d['commit']} |")
    return "\n".join(lines)


def plot(data: list[dict[str, Any]], path: Path) -> Path:
    """Samples/s and step time by split, one line per device and engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    series: dict[tuple, list[dict]] = {}
    for d in data:
        series.setdefault((d["device"], d["engine"], d["variant"]), []).append(d)
    for (device, engine, variant), points in series.items():
        points.sort(key=lambda d: (d["gpus"], d["split"]))
        labels = [f"{d['split']}\n({d['gpus']} GPUs)" for d in points]
        name = f"{engine}, {variant}, {device}"
        line, = axes[0].plot(labels, [d["samples_per_s"] for d in points], marker="o", label=name)
        first = points[0]  # linear in the GPU count from the smallest split: the goal
        axes[0].plot(labels, [first["samples_per_s"] * d["gpus"] / first["gpus"] for d in points],
                     linestyle=":", color=line.get_color(), label=f"{name}: linear")
        axes[1].plot(labels, [d["step_seconds"] for d in points], marker="o", label=name)
    axes[0].set(title="loop throughput (Qwen3-1.7B shape)", ylabel="samples / s", xlabel="trainer:rollout GPUs")
    axes[1].set(title="trainer step", ylabel="seconds per step", xlabel="trainer:rollout GPUs")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(results: Path, out: Path) -> str:
    """Write ``out/loop_profile.png``; the markdown table."""
    data = rows(load(results))
    if not data:
        raise ValueError(f"{results}: no loop_profile record names its trainer:rollout split")
    out.mkdir(parents=True, exist_ok=True)
    plot(data, out / "loop_profile.png")
    return table(data)
