"""D-ARL learns: the main job's defaults raise the built-in task's reward (fixed seeds, CPU).

This is the quick start's claim, checked from the run's own ``summary.json``: the mean reward of
the last 5 steps exceeds that of the first 5 by at least ``MARGIN`` within ``STEPS`` steps.
Measured on this 2-core machine (2026-11-23, five runs of 40 steps from one freshly fitted warm
start): gains 0.19, 0.19, 0.19, 0.24, 0.24 at step 40, but 0.105 to 0.29 at step 30 (a run can
plateau for a while), so the test runs 40 steps and the margin leaves room for the run-to-run
noise of asynchronous arrival order (which groups land in which step is timing-dependent even
with fixed seeds) and of the warm start fitted on another machine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
MARGIN = 0.12  # absolute reward (fraction of correct answers)


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
    assert gain >= MARGIN, (f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
                            f"(gain {gain:.3f} < {MARGIN})")
    assert "reward:" in proc.stdout and "plot" not in proc.stdout  # the end-of-run lines
