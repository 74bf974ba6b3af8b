"""Held-out points while training, end to end: the real main job on CPU (trainer and rollout
worker as separate processes over the real transport) with ``eval.every_n_steps=2`` writes one
held-out record per scored version (0, 2 and the final 4) into ``metrics.jsonl``, beside exactly
one record per training step, with the samples counted for training untouched; the launcher's
last lines and ``summary.json`` carry the first and last points."""

import json

from tests.distributed.test_loop_smoke import run_smoke

STEPS = 4


def test_heldout_points_at_start_every_two_versions_and_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_smoke(run_dir, "eval.benchmarks=[heldout]", "eval.every_n_steps=2", "eval.limit=32",
                     steps=STEPS, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    points = [r for r in rows if r.get("kind") == "heldout"]
    steps = [r for r in rows if r.get("kind") != "heldout"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert sorted(p["version"] for p in points) == [0, 2, 4] and all(p["step"] == p["version"] for p in points)
    for p in points:
        assert 0.0 <= p["heldout/builtin/avg@1"] <= 1.0 and p["heldout/builtin/pass@1"] == p["heldout/builtin/avg@1"]
        assert p["heldout/builtin/prompts"] == 32 and p["heldout_seconds"] > 0
    # evaluation is not training: every sample the steps counted came through the channel
    assert steps[-1]["samples_generated"] == sum(r["samples_received"] for r in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and [p["version"] for p in summary["heldout"]] == [0, 2, 4]
    assert "held-out: builtin" in proc.stdout and "at version 0 -> builtin" in proc.stdout
    assert "at version 4 (3 points in metrics.jsonl)" in proc.stdout
    worker_log = (run_dir / "logs" / "rollout0.log").read_text()
    assert worker_log.count("eval: version") == 3, worker_log[-2000:]
