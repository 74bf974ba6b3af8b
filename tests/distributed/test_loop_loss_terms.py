"""The main job on CPU with both optional loss terms on (entropy bonus, KL to the initial policy).

Two steps of ``experiment=smoke`` with ``algorithm.entropy_coef`` and ``algorithm.kl_coef`` set: the
run completes, every step logs ``entropy`` (in (0, log V]) and ``kl_ref`` (exactly 0 at step 0,
where the policy still is the reference, and >= 0 for k3), reference rows were computed, and the
checkpoint carries the reference weights (snapshot v0) a resume needs.
"""

import json
import math

from tests.distributed.test_loop_smoke import run_smoke


def test_smoke_run_with_entropy_and_kl_terms_logs_both(tmp_path):
    proc = run_smoke(tmp_path, "algorithm.entropy_coef=0.001", "algorithm.kl_coef=0.001",
                     "algorithm.kl_estimator=k3", steps=2)
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
