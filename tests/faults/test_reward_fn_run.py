"""``reward.fn`` in real ``python -m launch.train`` runs: a user's reward module written here (on
PYTHONPATH, as a user's would be) scores the samples in the rollout worker of a two-step smoke
run, and its exceptions are counted in the metrics, not the end of the run; names that cannot
serve are refused before launch (exit 2, one line naming ``reward.fn``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# the built-in task's check, as a verl user would write it; its first 8 calls (2 groups) raise
USER_REWARD = '''
import itertools, json, os, re

CALLS = itertools.count()

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    n = next(CALLS)
    with open(os.environ["CALLS_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "n": n, "data_source": data_source,
                            "index": extra_info["index"], "ground_truth": ground_truth}) + "\\n")
    if n < 8:
        raise RuntimeError("this reward has a bug")
    found = re.findall(r"answer:\\s*(-?\\d+)", solution_str)
    return 1.0 if found and int(found[-1]) == int(ground_truth) else 0.0
'''


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CALLS_LOG": str(tmp_path / "calls.jsonl"),
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


@pytest.mark.slow
@pytest.mark.fault(kind="input", name="user reward function raising on some samples, in a real run")
def test_a_user_reward_scores_a_real_run_and_its_errors_are_counted(tmp_path, fault_record):
    (tmp_path / "my_reward.py").write_text(USER_REWARD)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launch.train", "experiment=smoke", "loop.steps=2",
                           f"loop.run_dir={run_dir}", "reward.fn=my_reward:compute_score", "loop.plot=false"],
                          cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls and {c["data_source"] for c in calls} == {"builtin"}
    assert os.getpid() not in {c["pid"] for c in calls} and len({c["pid"] for c in calls}) == 1  # the worker
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    raised = {c["index"] for c in calls if c["n"] < 8}
    assert metrics[-1]["reward_errors"] == 8  # every raise counted (seconds before the last step)
    log = (run_dir / "logs" / "rollout0.log").read_text()
    named = [int(i) for i in re.findall(r"reward\.fn=my_reward:compute_score on prompt (\d+)\b", log)]
    assert len(named) == 4 and set(named) <= raised  # the 1st, 2nd, 4th and 8th failure, with the record's id
    assert log.count("Traceback") == 1  # the first failure's, which ends with the error again:
    assert log.count("RuntimeError: this reward has a bug") == 4 + 1
    saved = (run_dir / "run_config.yaml").read_text()
    assert "fn: my_reward:compute_score" in saved
    fault_record["observed"] = f"{len(calls)} calls, 8 raised; reward_errors={metrics[-1]['reward_errors']}"


def test_launch_refuses_a_reward_fn_that_cannot_serve_in_one_line(tmp_path):
    (tmp_path / "my_reward.py").write_text("compute_score = 3\n")
    cases = {"reward.fn=no_such_module:compute_score": "no module named 'no_such_module'",
             "reward.fn=my_reward:compute_score": "compute_score is a int, not a function"}
    procs = {o: subprocess.Popen([sys.executable, "-m", "launch.train", "experiment=smoke", o,
                                  f"loop.run_dir={tmp_path / str(i)}"], cwd=REPO, env=_env(tmp_path),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, o in enumerate(cases)}
    for i, (override, proc) in enumerate(procs.items()):
        out, err = proc.communicate(timeout=300)
        lines = [ln for ln in (out + err).splitlines() if ln.strip()]
        assert proc.returncode == 2, (override, out, err)
        assert len(lines) == 1 and lines[0].startswith(f"launch.train: {override}"), lines
        assert cases[override] in lines[0], lines[0]
        assert not (tmp_path / str(i)).exists()
