"""The variant study's plan: the window per case (D-ARL's K = 4 at every
staleness, eta + 1 for the queue baselines and ``darl_keta``), degenerate groups dropped and
refilled (``replay.fill_batch``, else the staleness collapses) unless asked, every step waiting
for the staleness bound (``loop.wait_for_bound``, else it depends on relative speeds), and a record pooled from the partial files of several device calls, each with its own
warm start (a seed block per call)."""

from __future__ import annotations

import json

import pytest

from benchmarks import variant_study as vs
from benchmarks.async_speedup import save_partial


def _args(*extra: str):
    args = vs.parse_args(["--cpu", "--size", "tiny", *extra])
    args.model_path = "/nowhere"
    return args


@pytest.mark.parametrize("case, eta, k", [("darl", 8, 4), ("darl_once", 1, 4), ("darl_nofilter", 4, 4),
                                          ("async", 8, 9), ("decoupled", 4, 5), ("darl_keta", 1, 2),
                                          ("darl_keta", 8, 9), ("sync", 0, 1)])
def test_each_case_gets_its_window(case, eta, k):
    preset, overrides = vs.case_overrides(case, eta, _args())
    assert f"replay.k={k}" in overrides and f"algorithm.max_staleness={eta}" in overrides
    assert preset == ("darl" if case == "darl_keta" else case)
    assert "replay.drop_degenerate=true" in overrides  # the spec's rule, by default
    assert "replay.fill_batch=true" in overrides  # and refilled: a step trains B groups, staleness stays real
    assert "loop.wait_for_bound=true" in overrides  # every step waits for the bound: data eta versions old
    assert not any("cap_mode" in o or "rollout_is" in o for o in overrides)  # presets make the variants


def test_the_default_plan_is_issue_39s_grid():
    args = _args()
    plan = vs.plan_runs(args.variants.split(","), [int(e) for e in args.staleness.split(",")],
                        [int(s) for s in args.seeds.split(",")])
    assert len(plan) == 5 * (1 + 7 * 3)  # sync + 7 cases at eta 1, 4, 8; 5 seeds
    assert {c for c, _, _ in plan} == {"sync", "async", "decoupled", "darl", "darl_once", "darl_nomis",
                                       "darl_nofilter", "darl_keta"}
    assert args.rollout_batch == "step"  # the worker stays eta versions ahead (the docstring)
    _, kept = vs.case_overrides("async", 4, _args("--keep-degenerate"))
    assert "replay.drop_degenerate=false" in kept and "replay.fill_batch=false" in kept  # fill needs dropping
    _, unfilled = vs.case_overrides("async", 4, _args("--no-fill"))
    assert "replay.drop_degenerate=true" in unfilled and "replay.fill_batch=false" in unfilled
    assert "loop.wait_for_bound=true" in kept and "loop.wait_for_bound=true" in unfilled  # in every run
    assert vs.settings(_args("--no-fill"), "ws")["no_fill"] and not vs.settings(_args(), "ws")["no_fill"]


def test_a_record_pools_the_partial_files_of_several_calls(tmp_path):
    args = _args("--seeds", "0,1", "--variants", "sync")
    run = {"final_accuracy": 0.1}
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    save_partial(a, vs.settings(args, "ws-A"), {"sync_eta0_s0": run}, device="H100")
    save_partial(b, vs.settings(args, "ws-B"), {"sync_eta0_s1": {"final_accuracy": 0.2}}, device="H100")
    args.partial, args.more_partials = a, [b, a]  # a repeated file holds the same runs: no clash
    done, device, config = vs.finished_runs(args)
    assert device == "H100" and config["warmstart"] == ["ws-A", "ws-B"]
    assert done == {"sync_eta0_s0": {**run, "warmstart": "ws-A"},
                    "sync_eta0_s1": {"final_accuracy": 0.2, "warmstart": "ws-B"}}
    save_partial(c, vs.settings(args, "ws-A"), {"sync_eta0_s0": {"final_accuracy": 0.3}}, device="H100")
    args.more_partials = [c]  # the same run of the same fit with other results: refused
    with pytest.raises(SystemExit, match="other results"):
        vs.finished_runs(args)
    save_partial(c, vs.settings(args, "task:ws-C"), {"sync_eta0_s0": {"final_accuracy": 0.3}}, device="H100")
    done, _, _ = vs.finished_runs(args)  # a seed's second fit, with its own sync run: both kept
    assert done["sync_eta0_s0@ws-C"] == {"final_accuracy": 0.3, "warmstart": "task:ws-C"}
    assert done["sync_eta0_s0"]["warmstart"] == "ws-A"
    for r in done.values():
        r.update(samples_to_target=None, wall_seconds=1.0, staleness_mean=0.0, initial_accuracy=0.0,
                 train_reward_last=0.0)
    metrics, _ = vs.aggregate(done, [("sync", 0, 0)])  # both runs of seed 0, each the base of its fit's pairs
    assert metrics["sync_eta0"]["final_accuracy"]["n"] == 2
    assert metrics["sync_eta0"]["final_accuracy"]["mean"] == pytest.approx(0.2)
    save_partial(c, vs.settings(args, "ws-C"), {"sync_eta0_s1": run}, device="H200")
    with pytest.raises(SystemExit, match="ran on H200"):
        vs.finished_runs(args)
    saved = json.loads(c.read_text())
    saved["config"]["lr"] = 1.0  # another setting than the record's: refused by name
    c.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="its runs were made with"):
        vs.finished_runs(args)
