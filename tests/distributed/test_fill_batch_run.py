"""Dynamic sampling end to end: the real main job on CPU (``launch.train experiment=smoke``,
trainer and rollout worker as separate processes over the real transport) with
``replay.fill_batch=true`` on the naive ``async`` variant (each group trained once, freshest first).

On the smoke task a good share of groups have equal rewards. With the filter every step trains B
groups (without it, a step trains the non-degenerate ones of the B that arrived: measured 1 of 2
at 5 of 8 steps), the drops are counted per step and in the ledger alike, no group is refused as
stale or trained past the bound, and the samples generated include the dropped ones."""

import json

from tests.distributed.test_loop_smoke import run_smoke

STEPS, B, ETA = 8, 2, 3


def test_every_step_trains_b_groups_and_the_drops_are_counted(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_smoke(run_dir, "algorithm=async", f"algorithm.max_staleness={ETA}", f"replay.k={ETA + 1}",
                     "replay.fill_batch=true", steps=STEPS, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["groups_selected"] for r in rows] == [B] * STEPS, [r["groups_selected"] for r in rows]
    dropped = sum(r["groups_degenerate"] for r in rows)
    assert dropped > 0 and rows[-1]["groups_refused_degenerate"] == dropped
    assert rows[-1]["groups_refused_stale"] == 0 and rows[-1]["groups_dropped"] == 0
    for r in rows:
        arrived = r["groups_degenerate"] + r["groups_received"]
        assert r["degenerate_share"] == (r["groups_degenerate"] / arrived if arrived else 0.0)
        assert r["version"] - r["selected_version_oldest"] <= ETA + 1  # trained at version - 1: age <= eta
    assert rows[-1]["samples_generated"] == sum(r["samples_received"] + r["samples_degenerate"] for r in rows)
    assert "degenerate groups dropped" not in proc.stdout + proc.stderr  # the guard (10 x B) never bound


def test_sync_with_a_whole_batch_engine_refills_the_drops(tmp_path):
    """eta 0 and an engine batch of B (the variant study's sync case): the bound has room only for
    the replacements of the groups dropped, fewer than a batch, and no publish comes before they
    do. The worker takes them as a smaller batch; it used to wait for room for a whole one until
    the trainer's receive timeout (9 of 16 groups, then nothing)."""
    run_dir = tmp_path / "run"
    proc = run_smoke(run_dir, "algorithm=sync", "replay.fill_batch=true", "loop.wait_for_bound=true",
                     "loop.receive_timeout_s=60", steps=6, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups_selected"] for r in rows] == [B] * 6
    assert sum(r["groups_degenerate"] for r in rows) > 0  # the drops the refills replaced
    assert all(r["version"] - r["selected_version_oldest"] <= 1 for r in rows)  # sync: trained at age 0
