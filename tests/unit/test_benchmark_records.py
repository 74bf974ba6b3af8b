"""The tools that turn benchmark runs into records and pages: async_speedup's per-run summary and
its resumable partial file, what a record reads back from a run's config, the benchmarks page with
per-case rows and pictures, the plot, and the scaling report over loop_profile records."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import async_speedup, record  # noqa: E402
from tools import benchmarks_table, plot_async_speedup, scaling_records  # noqa: E402


def _rows(rewards, per_step=128, dt=0.5, start=10.0):
    return [{"samples_generated": per_step * (i + 1), "wall_seconds": start + dt * i, "reward_mean": r}
            for i, r in enumerate(rewards)]


def test_summarize_run_counts_from_step_zero_and_finds_target():
    rows = _rows([0.1, 0.2, 0.4, 0.6, 0.7, 0.8, 0.9])
    out = async_speedup.summarize_run(rows, target=0.5)
    # 6 steps after step 0 -> 768 samples in 3 s
    assert out["samples_per_s"] == pytest.approx(768 / 3.0)
    # 5-step means: [0.1..0.7]=0.4, [0.2..0.8]=0.54 -> reached at row 5
    assert out["samples_to_target"] == 768 and out["seconds_to_target"] == pytest.approx(2.5)
    assert out["reward_last5"] == pytest.approx(0.68)
    assert len(out["curve"]) == 7 and out["curve"][0] == [128, 10.0, 0.1]
    assert async_speedup.summarize_run(rows, target=0.95)["samples_to_target"] is None


def test_partial_file_resumes_and_refuses_other_settings(tmp_path):
    path = tmp_path / "p.json"
    cfg = {"target": 0.5, "steps": 30}
    assert async_speedup.load_partial(path, cfg) == {}
    async_speedup.save_partial(path, cfg, {"sync_gpu1_s0": {"samples_per_s": 1.0}})
    assert async_speedup.load_partial(path, cfg) == {"sync_gpu1_s0": {"samples_per_s": 1.0}}
    with pytest.raises(SystemExit, match="p.json: its runs were made with"):
        async_speedup.load_partial(path, {"target": 0.6, "steps": 30})


def _record(metrics, benchmark="async_speedup"):
    return {"benchmark": benchmark, "device": "cpu", "date": "2026-11-23T00:00:00+00:00",
            "commit": "abcdef123", "config": {"size": "tiny", "target": 0.5}, "metrics": metrics}


def _case(rewards_per_seed):
    runs = [async_speedup.summarize_run(_rows(r), 0.5) for r in rewards_per_seed]
    return {"speedup_vs_sync": async_speedup.mean_std([1.0, 1.5][:len(runs)]), "runs": runs}


def test_benchmarks_page_has_a_row_per_case_and_the_picture(tmp_path):
    rec = _record({"sync_gpu1": _case([[0.1, 0.3, 0.5, 0.7, 0.9]]),
                   "darl_gpu2": _case([[0.2, 0.4, 0.6, 0.8, 0.9], [0.1, 0.2, 0.3, 0.4, 0.5]])})
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "async_speedup.png").write_bytes(b"png")
    page = benchmarks_table.render([rec], tmp_path)
    assert "![async_speedup](img/async_speedup.png)" in page
    rows = [line for line in page.splitlines() if line.startswith("| cpu")]
    assert len(rows) == 2
    assert any("darl_gpu2" in r and "1.25 ± 0.354 (n=2/2)" in r for r in rows)
    assert "![" not in benchmarks_table.render([rec], tmp_path / "absent")


def test_the_loop_profile_section_leads_with_splits_and_the_launch_timeline(tmp_path):
    _profile(tmp_path, "a", "darl", (1, 1), 16.0, 16.0)
    _profile(tmp_path, "b", "darl", (2, 2), 29.0, 8.8)
    recs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("loop_profile_*.json"))]
    recs[1]["metrics"].update(launch_to_first_step_seconds=94.4, launch_engine_start_seconds=58.9,
                              dynamo_compiles_after_first_step=0.0)
    page = benchmarks_table.render(recs)
    summary = page.index("Samples/s by trainer:rollout split")
    launch, full = page.index("Launch to the first trained step"), page.index("Every metric of each record")
    assert summary < launch < full
    timed = [line for line in page[launch:full].splitlines() if line.startswith("| NVIDIA")]
    assert len(timed) == 1 and "| 94.4 |" in timed[0] and "| 58.9 |" in timed[0]
    assert "| 1.81x |" in page[summary:launch]  # 29 / 16


def test_plot_draws_mean_band_over_seeds(tmp_path):
    grid, mean, std = plot_async_speedup.mean_band(
        [([0.0, 1.0, 2.0], [0.0, 1.0, 2.0]), ([0.0, 1.0], [2.0, 3.0])], points=3)
    assert grid == [0.0, 0.5, 1.0]  # up to the shortest curve
    assert mean == pytest.approx([1.0, 1.5, 2.0]) and std[0] == pytest.approx(2 ** 0.5)
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(_record({"darl_gpu2": _case([[0.1, 0.3, 0.5], [0.2, 0.2, 0.6]])})))
    out = tmp_path / "a.png"
    subprocess.run([sys.executable, str(REPO / "tools" / "plot_async_speedup.py"), str(path),
                    "--out", str(out)], check=True, timeout=120, capture_output=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    old = _record({"darl_gpu2": {"runs": [{"samples_per_s": 1.0}]}})
    with pytest.raises(SystemExit, match="darl_gpu2: the record has no per-run curves"):
        plot_async_speedup.plot(old, tmp_path / "b.png")


def test_splits_become_cluster_overrides():
    assert async_speedup.parse_splits("2:2,6:2") == ["t2r2", "t6r2"]
    assert async_speedup.parse_splits("") == []
    with pytest.raises(SystemExit, match="'4-4' is not TRAINER_GPUS:ROLLOUT_GPUS"):
        async_speedup.parse_splits("2:2,4-4")
    with pytest.raises(SystemExit, match="'0:2'"):
        async_speedup.parse_splits("0:2")
    assert async_speedup.cluster_overrides("gpu2", cpu=False) == ["cluster=gpu2"]
    assert async_speedup.cluster_overrides("t6r2", cpu=False) == [
        "cluster=gpu4", "cluster.trainer_gpus=6", "cluster.rollout_gpus=2"]
    assert async_speedup.cluster_overrides("t1r2", cpu=True)[0] == "cluster=cpu"


def test_vllm_profile_measures_the_hf_way_and_goes_on_past_a_way_that_fails(tmp_path):
    # CPU: the hf way runs (tiny model), a vLLM way fails here (no vLLM) and the record still lands
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "vllm_profile.py"), "--ways", "raw,hf",
                           "--model", "tiny", "--concurrency", "3", "--new-tokens", "6", "--prompt-tokens", "5",
                           "--repeats", "3", "--timeout", "120", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "raw: failed" in proc.stdout
    (path,) = tmp_path.glob("vllm_profile_cpu_*.json")
    record = json.loads(path.read_text())
    assert set(record["metrics"]) == {"hf"} and record["config"]["repeats"] == 3
    hf = record["metrics"]["hf"]
    assert hf["full_s_min"] <= hf["full_s"] <= hf["full_s_max"] and hf["over_hf"] == 1.0
    assert hf["tokens_per_s"] == pytest.approx(3 * 6 / hf["full_s"])


def test_a_record_reads_what_ran_from_the_runs_own_config(tmp_path):
    assert record.run_config_facts(tmp_path) == {}  # no run_config.yaml: nothing claimed
    (tmp_path / "run_config.yaml").write_text(
        "engine:\n  backend: vllm\nworker:\n  update_mode: interrupt\n  chunk_tokens: 0\n"
        "algorithm:\n  groups_per_step: 32\n  group_size: 8\nsampling:\n  max_new_tokens: 1024\n")
    assert record.run_config_facts(tmp_path) == {"engine": "vllm", "update_mode": "interrupt", "groups": 32,
                                                 "group_size": 8, "new_tokens": 1024}
    (tmp_path / "run_config.yaml").write_text("engine: [unclosed\n")
    with pytest.raises(ValueError, match="run_config.yaml: not valid YAML"):
        record.run_config_facts(tmp_path)


def test_amend_result_adds_metrics_and_keeps_the_rest(tmp_path):
    path = record.write_result("loop_profile", {"layout": "t1r1"}, {"step_seconds": 2.0}, tmp_path, device="cpu")
    before = json.loads(path.read_text())
    record.amend_result(path, {"step_to_decoupled": 1.5})
    after = json.loads(path.read_text())
    assert after["metrics"] == {"step_seconds": 2.0, "step_to_decoupled": 1.5}
    assert {k: v for k, v in after.items() if k != "metrics"} == {k: v for k, v in before.items() if k != "metrics"}


def test_async_speedup_sets_the_batch_it_is_given_and_names_the_engine_all_runs_agree_on():
    assert async_speedup.batch_overrides(argparse.Namespace(group_size=4, new_tokens=1024)) == [
        "algorithm.group_size=4", "sampling.max_new_tokens=1024"]
    assert async_speedup.batch_overrides(argparse.Namespace(group_size=8, new_tokens=None)) == [
        "algorithm.group_size=8"]  # the task preset's new tokens
    assert async_speedup.batch_overrides(argparse.Namespace()) == []  # variant_study sets its own
    assert async_speedup.agreed([{"engine": "vllm"}, {"engine": "vllm"}], "engine") == "vllm"
    assert async_speedup.agreed([{"engine": "vllm"}, {"engine": "hf"}], "engine") is None
    assert async_speedup.agreed([{"engine": "vllm"}, {}], "engine") is None  # an older partial file's run


def _profile(tmp_path, name, variant, split, samples_per_s, step_seconds, engine="vllm", commit="c1",
             date="2026-12-01T00:00:00+00:00", batch=(32, 8, 1024), **config):
    t, r = split
    cfg = {"variant": variant, "layout": f"t{t}r{r}", "trainer_gpus": t, "rollout_gpus": r, "engine": engine,
           "update_mode": "finish", "groups": batch[0], "group_size": batch[1], "new_tokens": batch[2],
           "overrides": [], **config}
    cfg = {k: v for k, v in cfg.items() if v is not None}  # None: a field older records lack
    rec = {"benchmark": "loop_profile", "device": "NVIDIA H100", "date": date, "commit": commit, "config": cfg,
           "metrics": {"samples_per_s": samples_per_s, "sustained_samples_per_s": samples_per_s,
                       "step_seconds": step_seconds, "train_seconds": 1.0}}
    (tmp_path / f"loop_profile_{name}.json").write_text(json.dumps(rec))


def test_the_scaling_rate_is_b_times_g_per_step_where_the_batch_is_known():
    rec = {"config": {"groups": 32, "group_size": 8}, "metrics": {"samples_per_s": 19.8, "step_seconds": 16.0}}
    assert scaling_records.rate(rec) == 16.0  # 256 a step, not the backlog a short run received
    assert scaling_records.rate({"config": {}, "metrics": {"samples_per_s": 19.8, "step_seconds": 16.0}}) == 19.8
    rec["metrics"]["sustained_samples_per_s"] = 17.0
    assert scaling_records.rate(rec) == 17.0


def test_scaling_report_gives_each_split_its_ratio_to_one_to_one_and_darl_over_decoupled(tmp_path):
    _profile(tmp_path, "a", "darl", (1, 1), 10.0, 4.0)
    _profile(tmp_path, "b", "darl", (2, 2), 18.0, 2.4)
    _profile(tmp_path, "c", "darl", (3, 1), 12.0, 3.0, groups_requested=32, batch=(33, 8, 1024))
    _profile(tmp_path, "d", "decoupled", (1, 1), 12.5, 3.2)
    _profile(tmp_path, "e", "decoupled", (2, 2), 20.0, 2.0)
    _profile(tmp_path, "f", "darl", (1, 1), 5.0, 8.0, batch=(8, 8, 512))  # another batch: its own 1:1
    _profile(tmp_path, "g", "darl", (2, 2), 7.5, 6.0, batch=(8, 8, 512))
    _profile(tmp_path, "h", "darl", (1, 1), 8.0, 5.0, engine="hf")  # the regression guard
    _profile(tmp_path, "i", "darl", (2, 2), 16.0, 2.5, engine="hf")
    _profile(tmp_path, "j", "darl", (1, 1), 99.0, 1.0, layout="gpu1")  # one shared GPU: not a split
    _profile(tmp_path, "l", "darl", (2, 2), 99.0, 1.0, batch=(8, 8, 512), date="2026-12-02T00:00:00+00:00",
             overrides=["rollout=vllm", "trainer.overlap_grad_reduce=true"])  # newest, but an A/B run
    # an older record that named a vLLM run hf: its overrides tell
    _profile(tmp_path, "k", "darl", (1, 1), 11.0, 3.6, engine="hf", commit="c0", date="2026-11-01T00:00:00+00:00",
             update_mode=None, overrides=["rollout@_global_=vllm"])
    data = scaling_records.rows(scaling_records.load(tmp_path))
    got = {(d["engine"], d["variant"], d["batch"], d["split"]): d for d in data}
    assert len(data) == 9 and ("vllm", "darl", "32x8x1024", "1:1") in got
    assert got[("vllm", "darl", "32x8x1024", "1:1")]["samples_per_s"] == 10.0  # newest of the two 1:1s
    assert got[("vllm", "darl", "32x8x1024", "2:2")]["vs_1to1"] == pytest.approx(1.8)
    assert got[("vllm", "darl", "32x8x1024", "3:1")]["vs_1to1"] == pytest.approx(1.2)  # ran 33, asked 32
    assert got[("vllm", "decoupled", "32x8x1024", "2:2")]["vs_1to1"] == pytest.approx(1.6)
    assert got[("vllm", "darl", "8x8x512", "2:2")]["vs_1to1"] == pytest.approx(1.5)
    assert got[("hf", "darl", "32x8x1024", "2:2")]["vs_1to1"] == pytest.approx(2.0)
    assert got[("vllm", "darl", "32x8x1024", "2:2")]["darl_to_decoupled"] == pytest.approx(1.2)
    assert got[("vllm", "darl", "32x8x1024", "1:1")]["darl_to_decoupled"] == pytest.approx(1.25)
    assert got[("vllm", "darl", "32x8x1024", "3:1")]["darl_to_decoupled"] is None  # no decoupled at 3:1
    assert [d["engine"] for d in data][-2:] == ["hf", "hf"]  # the guard comes last
    text = scaling_records.table(data)
    guard = text.index("hf: regression guard")
    assert text.index("| 1.80x |") < guard < text.index("| 2.00x |")
    assert scaling_records.report(tmp_path, tmp_path / "img").startswith("| device |")
    assert (tmp_path / "img" / "loop_profile.png").read_bytes()[:4] == b"\x89PNG"


def test_scaling_report_compares_with_the_same_commits_one_to_one_first(tmp_path):
    _profile(tmp_path, "a", "darl", (1, 1), 18.0, 3.0, commit="old", date="2026-11-01T00:00:00+00:00")
    _profile(tmp_path, "b", "darl", (2, 2), 27.0, 2.0, commit="old", date="2026-11-01T00:10:00+00:00")
    _profile(tmp_path, "c", "darl", (1, 1), 12.0, 4.0, commit="new", date="2026-11-02T00:00:00+00:00")
    _profile(tmp_path, "d", "darl", (3, 1), 24.0, 4.0, commit="other", date="2026-11-03T00:00:00+00:00")
    got = {d["split"]: d for d in scaling_records.rows(scaling_records.load(tmp_path))}
    assert got["2:2"]["vs_1to1"] == pytest.approx(1.5) and got["2:2"]["other_commit"] == []  # 27 / 18
    assert got["3:1"]["vs_1to1"] == pytest.approx(2.0) and got["3:1"]["other_commit"] == ["vs_1to1"]
    assert "| 2.00x* |" in scaling_records.table(list(got.values()))


def test_a_records_note_is_numbered_in_its_row_and_printed_under_the_table(tmp_path):
    _profile(tmp_path, "a", "darl", (1, 1), 10.0, 4.0)
    _profile(tmp_path, "b", "darl", (2, 2), 11.0, 3.6)
    rec = json.loads((tmp_path / "loop_profile_b.json").read_text())
    rec["note"] = "two outliers in five steps"
    (tmp_path / "loop_profile_b.json").write_text(json.dumps(rec))
    text = scaling_records.table(scaling_records.rows(scaling_records.load(tmp_path)))
    row = next(line for line in text.splitlines() if "| 2:2 |" in line)
    assert "| darl [1] |" in row and "| darl |" in next(x for x in text.splitlines() if "| 1:1 |" in x)
    assert text.endswith("\n\n[1] two outliers in five steps")


def test_train_step_set_reads_typed_trainer_fields_and_refuses_unknown_ones():
    from benchmarks.train_step import trainer_settings

    got = trainer_settings(["grad_reduce_in_fp32=false", "overlap_grad_reduce=True", "peak_tflops=700.5",
                            "seed=7", "snapshots=host"])
    assert got == {"grad_reduce_in_fp32": False, "overlap_grad_reduce": True, "peak_tflops": 700.5,
                   "seed": 7, "snapshots": "host"}
    from megatron_darl.trainer.config import TrainerConfig
    assert TrainerConfig(**got).grad_reduce_in_fp32 is False  # what the benchmark builds
    for bad in ("grad_reduce=false", "micro_batch=1", "bf16"):
        with pytest.raises(SystemExit, match="grad_reduce_in_fp32"):
            trainer_settings([bad])


def _reads_back(x):
    return [float(v.sum().item()) for v in x]


def test_train_step_profile_names_the_line_that_syncs_the_host():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.train_step import host_syncs_by_caller

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        _reads_back([torch.ones(4)] * 3)
        torch.ones(2).sum()  # no read-back: not counted
    report = host_syncs_by_caller(prof.events())
    rows = [line for line in report.splitlines()[1:] if "aten::item" in line]
    assert len(rows) == 1, report
    assert rows[0].split()[0] == "3" and "_reads_back" in rows[0], report


def _pretend_sync():
    import warnings

    warnings.warn("called a synchronizing CUDA operation")  # what CUDA's sync debug mode says


def test_train_step_sync_counter_names_the_line_that_warned_of_a_sync():
    import warnings

    from benchmarks.train_step import syncs_by_warning

    def work():
        for _ in range(3):
            _pretend_sync()
        warnings.warn("something else")  # not a sync: not counted

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = syncs_by_warning(work)
        warnings.warn("after")  # the counter gave the warnings machinery back
    lines = report.splitlines()
    assert "(3 in all;" in lines[0], report
    assert len(lines) == 2 and lines[1].split()[0] == "3", report
    assert ": _pretend_sync <- " in lines[1] and lines[1].endswith(": work"), report
    assert [str(w.message) for w in seen] == ["after"]
