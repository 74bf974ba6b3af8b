"""Exact backfill across a resume, on the loop's own step (``StepRunner``, DP2, darl, K = 4).

A checkpoint carries the parameter snapshots of the window (``save_checkpoint(...,
with_snapshots=True)``, what ``TrainerLoop.save`` writes for mixture variants), so a run resumed
into fresh processes backfills exactly as the uninterrupted run does:

* the K - 1 = 3 steps after the resume give bitwise the weights of the uninterrupted run, with
  the same ``backfill_snapshot`` counts and no ``backfill_nearest`` fallback;
* the snapshot path is taken (counts > 0) and every row it produced equals a reference
  recomputation with transformers at the weights of that version (recorded after each step);
* negative control: resuming without the snapshots falls back to nearest-version rows
  (``backfill_nearest`` > 0) and the weights drift from the uninterrupted run's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "procs"))
import resume_procs  # noqa: E402
import trainer_procs  # noqa: E402

ROW_TOL = 1e-5  # Megatron (padded micro-batches) vs HF, fp32
pytestmark = pytest.mark.slow  # ~50 s: three 2-rank runs of 3 to 7 steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_darl.trainer.parallel import run_local_gloo

    work = tmp_path_factory.mktemp("resume_backfill")
    trainer_procs.save_tiny_hf(work / "hf")
    out = {}
    for mode in ("straight", "resume", "nosnap"):
        args = (mode, str(work / "hf"), str(work / "ckpt"), str(work / "groups.pt"),
                str(work / f"{mode}.pt"))
        run_local_gloo(resume_procs.resume_worker, 2, args=args, timeout_s=600)
        out[mode] = torch.load(work / f"{mode}.pt", weights_only=False)
    return work, out


def test_resumed_steps_equal_the_uninterrupted_run(runs):
    _, out = runs
    straight, resumed = out["straight"], out["resume"]
    phases = straight["save_phases"]  # what the checkpoint log line reports, per phase
    assert list(phases) == ["state", "snapshots", "seal"] and all(t > 0 for t in phases.values())
    assert (Path(runs[0]) / "ckpt" / "snapshots").is_dir()
    assert resumed["snapshots_at_start"] == list(range(resume_procs.RESUME_AT - resume_procs.K + 1,
                                                       resume_procs.RESUME_AT + 1))
    after = range(resume_procs.RESUME_AT, resume_procs.STEPS)
    assert sum(straight["backfill"][s][0] for s in after) > 0  # the snapshot path is taken
    for s in after:
        assert resumed["backfill"][s] == straight["backfill"][s], s
        assert straight["backfill"][s][1] == 0 and resumed["backfill"][s][1] == 0, s
        for name, value in straight["params"][s].items():
            assert torch.equal(resumed["params"][s][name], value), (s, name)


def test_without_snapshots_the_resume_falls_back_and_drifts(runs):
    _, out = runs
    straight, nosnap = out["straight"], out["nosnap"]
    after = range(resume_procs.RESUME_AT, resume_procs.STEPS)
    assert nosnap["snapshots_at_start"] == [resume_procs.RESUME_AT]
    assert sum(nosnap["backfill"][s][1] for s in after) > 0
    last = resume_procs.STEPS - 1
    assert any(not torch.equal(nosnap["params"][last][k], v) for k, v in straight["params"][last].items())


def test_snapshot_rows_equal_a_reference_recomputation(runs):
    import transformers

    work, out = runs
    straight = out["straight"]
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.float32)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    rows = straight["rows"]
    assert len(rows) > 0
    by_version: dict[int, list] = {}
    for r in rows:
        by_version.setdefault(r[2], []).append(r)
    worst = 0.0
    for version, group in sorted(by_version.items()):
        weights = initial if version == 0 else straight["params"][version - 1]
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
        with torch.no_grad():
            for prompt, response, _, row in group:
                ids = torch.cat([prompt, response])
                logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1)
                ref = logp.gather(-1, ids[1:, None])[-response.numel():, 0]
                worst = max(worst, float((ref - row).abs().max()))
    assert worst < ROW_TOL, worst
