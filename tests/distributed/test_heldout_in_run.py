"""Held-out points while training, end to end: the real main job on CPU (trainer and rollout
worker as separate processes over the real transport) with ``eval.every_n_steps=2`` writes one
held-out record per scored version (0, 2 and the final 4) into ``metrics.jsonl``, beside exactly
one record per training step, with the samples counted for training untouched; the launcher's
last lines and ``summary.json`` carry the first and last points. On a loaded machine the worker
can come to version 2's weight sync late and load 3 instead: it must then name 2 as not scored,
and the run ends at once rather than waiting eval.timeout_s (600 s) for that point."""

import json

from tests.distributed.test_loop_smoke import run_smoke

STEPS = 4


def test_heldout_points_at_start_every_two_versions_and_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_smoke(run_dir, "eval.benchmarks=[heldout]", "eval.every_n_steps=2", "eval.limit=32",
                     steps=STEPS, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    points = [r for r in rows if r.get("kind") == "heldout"]
    steps = [r for r in rows if r.get("kind") != "heldout"]
    worker_log = (run_dir / "logs" / "rollout0.log").read_text()
    went_past = "eval: version 2 not scored: rollout worker 0 went from version" in worker_log
    versions = [0, 4] if went_past else [0, 2, 4]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert sorted(p["version"] for p in points) == versions and all(p["step"] == p["version"] for p in points)
    for p in points:
        assert 0.0 <= p["heldout/builtin/avg@1"] <= 1.0 and p["heldout/builtin/pass@1"] == p["heldout/builtin/avg@1"]
        assert p["heldout/builtin/prompts"] == 32 and p["heldout_seconds"] > 0
    # evaluation is not training: every sample the steps counted came through the channel
    assert steps[-1]["samples_generated"] == sum(r["samples_received"] for r in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and [p["version"] for p in summary["heldout"]] == versions
    assert "held-out: builtin" in proc.stdout and "at version 0 -> builtin" in proc.stdout
    # the last line names the first and last points, and how many there are when more than those
    count = f" ({len(versions)} points in metrics.jsonl)" if len(versions) > 2 else ""
    assert f"at version 4{count}\n" in proc.stdout
    assert worker_log.count("eval: version") == 3, worker_log[-2000:]  # scored, or named as gone past
    assert max(r["wall_seconds"] for r in rows) < 400  # no wait for a point that cannot come (eval.timeout_s: 600)
