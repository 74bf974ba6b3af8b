"""A variant-study run whose device call ended during its evaluation loses nothing: the
checkpoint being deleted is renamed first (never listed again half deleted, which once failed
the next call's evaluation), and a run whose training finished is recognised for evaluation
only (``--reuse-trained``), while one cut short in training is not."""

import json

from benchmarks.variant_study import trained_run
from megatron_darl.eval.heldout import list_checkpoints


def _run_dir(tmp_path, rows: int, checkpoints: list[str]):
    run = tmp_path / "run"
    for name in checkpoints:
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "__0_0.distcp").write_bytes(b"x")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(rows)))
    return run


def test_a_checkpoint_being_deleted_is_not_listed(tmp_path):
    run = _run_dir(tmp_path, 4, ["step_000002", "step_000004.scored", "step_000003", "notes"])
    assert [(s, p.name) for s, p in list_checkpoints(run)] == [(2, "step_000002"), (3, "step_000003")]


def test_only_a_run_whose_training_finished_is_reused(tmp_path):
    run = _run_dir(tmp_path, 4, ["step_000004"])
    reused = trained_run(run, 4)
    assert reused is not None and [r["step"] for r in reused["rows"]] == [0, 1, 2, 3]
    assert trained_run(run, 6) is None  # 4 rows of 6: cut short in training
    with open(run / "metrics.jsonl", "a") as f:  # the loop's own held-out points are no steps
        f.write("".join(json.dumps({"step": s, "kind": "heldout"}) + "\n" for s in (0, 4)))
    assert trained_run(run, 5) is None and [r["step"] for r in trained_run(run, 4)["rows"]] == [0, 1, 2, 3]
    (run / "checkpoints" / "step_000004").rename(run / "checkpoints" / "step_000004.scored")
    assert trained_run(run, 4) is None  # no checkpoint and no points: nothing to evaluate
    (run / "heldout.json").write_text(json.dumps({"points": [{"step": 0}, {"step": 4}]}))
    assert trained_run(run, 4) is not None  # every point scored, the record not yet written
