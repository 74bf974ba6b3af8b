"""``trainer.overlap_grad_reduce``: at DP2 the gradient buckets are reduce-scattered while the
backward runs (issued before ``finalize_model_grads``, which then only waits), and the update is
the one the reduce after the backward gives. Two gloo processes, two mini-batches of several
micro-batches each (the schedule runs all but the last under ``no_sync``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "procs"))
import trainer_procs  # noqa: E402

from megatron_darl.trainer.parallel import run_local_gloo  # noqa: E402


def test_overlapped_reduce_is_issued_in_the_backward_and_gives_the_same_update(tmp_path):
    trainer_procs.save_tiny_hf(tmp_path / "hf")
    out = tmp_path / "overlap.pt"
    run_local_gloo(trainer_procs.overlap_worker, 2, args=(str(tmp_path / "hf"), str(out)), timeout_s=300)
    got = torch.load(out, weights_only=False)
    after, overlapped = got[False], got[True]
    assert min(after["microbatches"]) >= 2, after["microbatches"]  # no_sync had micro-batches to hold
    assert after["in_flight"] == [False] * 4  # reduced in finalize, after the backward
    # Megatron learns on a run's first mini-batch which parameters get gradients (its reduce
    # waits for finalize); from the second on each bucket is issued in the backward
    assert overlapped["in_flight"] == [False, True, True, True]
    assert overlapped["loss"] == after["loss"]
    worst = max(float((overlapped["params"][k] - p).abs().max()) for k, p in after["params"].items())
    moved = max(float(p.abs().max()) for p in after["params"].values())
    assert worst <= 1e-6 * max(moved, 1.0), worst
