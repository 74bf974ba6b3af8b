"""Replay state on the hub rank only: the loop's step at TP2 and TP2 x PP2 equals TP1.

One DP replica runs four darl steps of the real ``StepRunner`` (``procs/replica_procs.py``):
the hub alone holds the planner, makes the groups and decides every trainer call; its peers get
the batches by broadcast. Checked: only the hub holds replay state (bytes > 0 there, no planner
elsewhere), every rank ran the same passes, snapshot backfill ran, and the weights after every
step equal the TP1 run's within the layout tolerance of ``test_trainer_layouts.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "procs"))
import replica_procs  # noqa: E402
import trainer_procs  # noqa: E402

PARAM_TOL = 5e-5  # fp32 CPU, TP2/PP2 vs TP1 after four Adam steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_darl.trainer.parallel import run_local_gloo

    work = tmp_path_factory.mktemp("replica")
    trainer_procs.save_tiny_hf(work / "hf")
    out = {}
    for name, (tp, pp) in {"tp1": (1, 1), "tp2": (2, 1), "tp2pp2": (2, 2)}.items():
        path = work / f"{name}.pt"
        run_local_gloo(replica_procs.replica_worker, tp * pp, args=(tp, pp, str(work / "hf"), str(path)),
                       timeout_s=600)
        out[name] = torch.load(path, weights_only=False)
    return out


@pytest.mark.parametrize("name", ["tp2", "tp2pp2"])
def test_only_the_hub_holds_replay_state_and_every_rank_runs_the_same_passes(runs, name):
    ranks = runs[name]["ranks"]
    hubs = [r for r in ranks if r["hub"]]
    assert len(hubs) == 1 and hubs[0]["rank"] == 0 and hubs[0]["replay_bytes"] > 0
    assert all(not r["planner"] and r["replay_bytes"] == 0 for r in ranks if not r["hub"])
    assert all(r["passes"] == hubs[0]["passes"] for r in ranks)  # each announced pass ran everywhere
    assert any(v < t for t, v in hubs[0]["passes"])  # snapshot backfill passes (an older version)
    assert sum(runs[name]["backfill"].values()) > 0


@pytest.mark.parametrize("name", ["tp2", "tp2pp2"])
def test_steps_equal_the_single_rank_run(runs, name):
    ref, run = runs["tp1"], runs[name]
    for step, params in ref["params"].items():
        worst = max(float((run["params"][step][k] - v).abs().max()) for k, v in params.items())
        assert worst <= PARAM_TOL, (step, worst)
        assert run["loss"][step] == pytest.approx(ref["loss"][step], rel=1e-4, abs=1e-6)
    moved = max(float((ref["params"][replica_procs.STEPS - 1][k] - v).abs().max())
                for k, v in ref["params"][0].items())
    assert moved > 100 * PARAM_TOL  # the steps moved the weights well beyond the tolerance
