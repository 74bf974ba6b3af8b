"""The tools that turn benchmark runs into records and pages: async_speedup's per-run summary and
its resumable partial file, the benchmarks page with per-case rows and pictures, and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import async_speedup  # noqa: E402
from tools import benchmarks_table, plot_async_speedup  # noqa: E402


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
