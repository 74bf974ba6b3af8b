"""The main job on CPU with both optional loss terms on (entropy bonus, KL to the initial policy).

Two steps of ``experiment=smoke`` with ``algorithm.entropy_coef`` and ``algorithm.kl_coef`` set (and
``replay.fill_batch``, so that each step trains): the run completes, every step logs ``entropy``
(in (0, log V]) and ``kl_ref`` (exactly 0 at step 0, where the policy still is the reference, and
>= 0 for k3), reference rows were computed, and the checkpoint carries the reference weights
(snapshot v0) a resume needs. At TP = 2 (slow) a run (sync: its steps do not depend on timing)
logs what TP = 1 logs: the entropy's extra all-reduce, the reference pass and the regularised
inputs' broadcast to the hub's TP peer.
"""

import json
import math

import pytest

from tests.distributed.test_loop_smoke import run_smoke

TERMS = ("algorithm.entropy_coef=0.001", "algorithm.kl_coef=0.001", "algorithm.kl_estimator=k3")


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("terms_tp1")
    # replay.fill_batch: every step trains B groups of unequal rewards (at 2 groups of 4 from the
    # tiny policy, a step of two all-zero groups trains nothing, and has no entropy to log)
    return run_dir, run_smoke(run_dir, *TERMS, "replay.fill_batch=true", steps=2)


def test_smoke_run_with_entropy_and_kl_terms_logs_both(tp1):
    tmp_path, proc = tp1
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    ckpt = tmp_path / "checkpoints" / "step_000002"
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    for r in rows:
        assert 0 < r["entropy"] <= math.log(vocab) and math.isfinite(r["loss"])
        assert r["kl_ref"] >= 0 and r["ref_rows"] >= 1
    assert rows[0]["kl_ref"] == 0.0  # one optimizer step at version 0: pi_theta is pi_ref
    assert rows[1]["kl_ref"] > 0
    assert (ckpt / "snapshots" / "v00000000").is_dir()
    assert "KL reference: the initial weights kept as snapshot v0" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_terms_at_tp2_log_what_tp1_logs(tmp_path):
    # sync (eta 0): each step trains exactly the groups of its version, whatever the timing
    runs = [run_smoke(tmp_path / f"tp{tp}", *TERMS, "algorithm=sync", f"cluster.trainer_ranks={tp}",
                      f"parallel.tp={tp}", steps=2) for tp in (1, 2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = ([json.loads(line) for line in (tmp_path / f"tp{tp}" / "metrics.jsonl").read_text().splitlines()]
                for tp in (1, 2))
    for a, b in zip(one, two, strict=True):
        # a step that trained no token (its groups all degenerate) logs neither term, at both TPs
        assert ("entropy" in a, "kl_ref" in a) == ("entropy" in b, "kl_ref" in b), (a["step"], b["step"])
        for key in ("entropy", "kl_ref", "loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-5), key
        assert b["ref_rows"] == a["ref_rows"]
    assert any("entropy" in a for a in one)  # the terms were compared at some step
