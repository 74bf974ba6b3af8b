"""D-ARL learns: the main job's defaults raise the built-in task's reward and its held-out accuracy
(fixed seeds, CPU).

This is the quick start's claim, checked from the run's own ``summary.json``: the greedy accuracy
on the held-out prompts (``eval.*``, scored by the rollout worker at version 0 and at the end)
rises by at least ``HELDOUT_MARGIN``, and the mean reward of the last 5 training steps exceeds
that of the first 5 by at least ``REWARD_MARGIN``. Measured on this 2-core machine: held-out
0.000 -> 0.340 and 0.000 -> 0.355 (2026-11-27); training-reward gains 0.19, 0.19, 0.19, 0.24,
0.24 at step 40 (2026-11-23, five runs from one warm start), then 0.22, 0.119 and 0.079 with the
held-out evaluation on (2026-11-27; its generations advance the engine's seed counter, so the
training samples differ from those runs; the 0.079 run peaked near 0.5 at steps 15-20 and the
held-out point there was 0.230). The training reward is the noisier of the two: which groups land
in which step is timing-dependent even with fixed seeds; the held-out point is greedy on fixed
prompts.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
REWARD_MARGIN = 0.05  # absolute reward (fraction of correct answers)
HELDOUT_MARGIN = 0.15  # greedy held-out accuracy, the end over version 0


@pytest.mark.slow
def test_darl_raises_reward_from_the_warm_start(tmp_path):
    cmd = [sys.executable, "-m", "launch.train", "algorithm=darl", f"loop.run_dir={tmp_path}",
           "transport.control.port=0", "cluster.master_port=0", "cluster=cpu",
           f"loop.steps={STEPS}", "loop.progress_bar=false", "loop.plot=false"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["reward_window_steps"] == 5
    gain = summary["reward_last"] - summary["reward_first"]
    assert gain >= REWARD_MARGIN, (f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
                                   f"(gain {gain:.3f} < {REWARD_MARGIN})")
    points = {p["version"]: p["heldout/builtin/avg@1"] for p in summary["heldout"]}
    assert sorted(points) == [0, STEPS], summary["heldout"]
    assert points[STEPS] - points[0] >= HELDOUT_MARGIN, f"held-out {points[0]:.3f} -> {points[STEPS]:.3f}"
    assert "reward:" in proc.stdout and "plot" not in proc.stdout  # the end-of-run lines
