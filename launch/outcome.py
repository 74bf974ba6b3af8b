"""The lines a finished run ends with: steps and time, reward before -> after, the held-out points,
where the summary and the plot are. ``launch.train`` prints them at the end of the quick start and
``slurm/launch.sh`` at the end of a job (``python -m launch.slurm outcome``), so a run reads the
same however it was started. It reads ``summary.json``.
"""

from __future__ import annotations

import json
from pathlib import Path


def outcome(run_dir: Path, planned: int | None = None) -> str:
    """The end-of-run lines: reward before -> after, and where the summary and the plot are; a run
    that stopped before its ``planned`` steps (a stop request) says so, and how to go on."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return f"done: {run_dir} (no summary.json: no step finished)"
    s = json.loads(summary_path.read_text())
    if planned is not None and s["steps"] < planned:
        lines = [f"stopped: {s['steps']} of {planned} steps in {s['wall_seconds']:.0f} s, run dir {run_dir} "
                 "(loop.resume=true goes on from its newest checkpoint)"]
    else:
        lines = [f"done: {s['steps']} steps in {s['wall_seconds']:.0f} s, run dir {run_dir}"]
    if s.get("reward_first") is not None:
        lines.append(f"reward: {s['reward_first']:.3f} (first {s['reward_window_steps']} steps) -> "
                     f"{s['reward_last']:.3f} (last {s['reward_window_steps']} steps)")
    points = s.get("heldout") or []
    if points:
        from megatron_darl.loop.metrics import describe_point

        ends = [points[0], points[-1]] if len(points) > 1 else points
        lines.append("held-out: " + " -> ".join(f"{describe_point(p)} at version {p['version']}" for p in ends)
                     + (f" ({len(points)} points in metrics.jsonl)" if len(points) > 2 else ""))
    plot = run_dir / "progress.png"
    lines.append(f"summary: {summary_path}" + (f"   plot: {plot}" if plot.exists() else ""))
    return "\n".join(lines)
