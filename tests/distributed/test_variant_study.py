"""The variant study at a CI size: a real main-job run on the countdown task, its checkpoints
scored on the held-out split, one record with the fields the report reads, a resumed second
call that reruns nothing, a record of the finished runs only (a study cut short), and the report
tool rendering the record into a results page."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def _study(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "benchmarks/variant_study.py", "--cpu", "--size", "tiny",
           "--variants", "darl", "--staleness", "1", "--seeds", "0", "--steps", str(STEPS),
           "--groups", "2", "--group-size", "4", "--eval-every", "1", "--test-prompts", "8", "--eval-samples", "2",
           "--max-new-tokens", "24", "--warmstart-steps", "4", "--warmstart-prompts", "256",
           "--target", "0.0", "--out-dir", str(tmp_path / "out"), "--run-root", str(tmp_path / "runs"),
           "--partial", str(tmp_path / "partial.json"), *extra,
           "transport.control.port=0", "cluster.master_port=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_variant_study_runs_resumes_and_reports(tmp_path):
    proc = _study(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record_path,) = (tmp_path / "out").glob("variant_study_*.json")
    record = json.loads(record_path.read_text())
    assert {"benchmark", "device", "date", "commit", "config", "metrics"} <= set(record)
    assert record["benchmark"] == "variant_study" and record["config"]["samples_per_run"] == STEPS * 2 * 4
    case = record["metrics"]["darl_eta1"]
    assert case["variant"] == "darl" and case["max_staleness"] == 1
    for key in ("final_accuracy", "samples_to_target", "wall_seconds"):
        assert case[key]["n"] == 1 and case[key]["mean"] is not None, key
    # degenerate groups dropped: at this size a step may train none, so no age to average then
    trained = case["runs"][0]["groups_trained_per_step"]
    assert 0.0 <= trained <= 2.0 and (case["staleness_mean"]["n"] == 1) == (trained > 0)
    (run,) = case["runs"]
    # one evaluation per step plus the initial policy, at the samples the run had generated
    assert [c[0] for c in run["curve"]] == list(range(STEPS + 1))
    assert [c[1] for c in run["curve"]] == [0.0, 8.0, 16.0]  # consumed: B x G per step
    generated = [c[4] for c in run["curve"]]  # the rollout ran eta versions ahead (a backlog)
    assert generated == sorted(generated) and generated[-1] >= 16.0
    assert all(0.0 <= c[3] <= 1.0 and c[3] == c[5] and 0.0 <= c[6] <= 1.0 for c in run["curve"])
    assert run["samples_to_target"] == 0.0  # target 0: reached by the initial policy
    assert len(run["train"]) == STEPS and run["train"][0]["reward_mean"] is not None
    # where the run's minutes went: its launch phases (from the run's timeline) and its scoring
    assert 0 < run["launch_phases"]["launch_to_first_step_seconds"] < run["launch_seconds"]
    assert 0 < run["eval_seconds"] < run["run_seconds"]
    assert not list((tmp_path / "runs").glob("*/checkpoints/step_*"))  # deleted once scored

    # a second call with the same partial file reruns nothing and writes the same numbers
    os.rename(tmp_path / "runs", tmp_path / "runs_first")
    again = _study(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (tmp_path / "runs").exists()
    records = sorted((tmp_path / "out").glob("variant_study_*.json"))
    second = json.loads(records[-1].read_text()) if len(records) > 1 else record
    assert second["metrics"]["darl_eta1"]["runs"] == case["runs"]

    # a study cut short: the record of what finished, the rest named, nothing fitted or run
    saved = json.loads((tmp_path / "partial.json").read_text())
    assert saved["device"] == record["device"]  # where the runs ran, for a record made elsewhere
    cut = _study(tmp_path, "--variants", "darl,async", "--record-finished")
    assert cut.returncode == 0, cut.stdout[-3000:] + cut.stderr[-3000:]
    assert not (tmp_path / "runs").exists() and "left out: async_eta1_s0" in cut.stdout
    finished = json.loads(max((tmp_path / "out").glob("variant_study_*.json"), key=os.path.getmtime).read_text())
    assert finished["config"]["left_out"] == ["async_eta1_s0"] and list(finished["metrics"]) == ["darl_eta1"]
    # each run names the warm start of its partial file (a record may pool several device calls)
    assert finished["metrics"]["darl_eta1"]["runs"] == [{**r, "warmstart": saved["config"]["warmstart"]}
                                                         for r in case["runs"]]
    assert finished["device"] == record["device"]
    other = _study(tmp_path, "--record-finished", "--lr", "0.5")  # not the settings the runs ran under
    assert other.returncode != 0 and "partial.json: its runs were made with" in other.stderr
    (tmp_path / "partial.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "device"}))
    unnamed = _study(tmp_path, "--record-finished")  # an older partial file: no device to name
    assert unnamed.returncode != 0 and "names no device its runs ran on" in unnamed.stderr

    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nwritten by hand\n\n<!-- variant_report:begin -->\nold\n<!-- variant_report:end -->\n")
    report = subprocess.run([sys.executable, "tools/variant_report.py", str(record_path), "--doc", str(doc)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    text = doc.read_text()
    assert "written by hand" in text and "\nold\n" not in text  # darl: max staleness 1, K 4, one seed
    assert "| darl | 1 | 4 | 1 |" in text and (tmp_path / "img" / f"{record_path.stem}.png").stat().st_size > 0
