"""tools/scaling_report.py on run directories written here: the samples it counts as trained,
and the warning for a run whose steps trained nothing (the tests/slurm study covers real runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tools import scaling_report


def write_run(root: Path, name: str, nodes: int, samples: list[float], step_s: float) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"nodes": nodes, "steps": len(samples)}))
    cluster = {"trainer_ranks": nodes, "rollout_workers": nodes}
    (run / "run_config.yaml").write_text(yaml.safe_dump({"cluster": cluster}))
    rows = [{"step": i, "step_seconds": step_s, "receive_wait_seconds": 0.1, "weight_sync_seconds": 0.2,
             "trainer_tokens_per_s": 100.0 * n, "rollout_tokens_per_s": 500.0, "samples_selected": n}
            for i, n in enumerate(samples)]
    rows.insert(1, {"kind": "heldout", "step": 1, "score": 0.5})  # a held-out point is not a step
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


def test_samples_per_second_are_samples_trained_over_the_steady_steps_wall_time(tmp_path):
    one = write_run(tmp_path, "nodes_1", 1, [7, 64, 64, 32], step_s=2.0)
    two = write_run(tmp_path, "nodes_2", 2, [7, 64, 64, 64], step_s=1.0)
    rows = scaling_report.build_report([two, one], tmp_path / "report", skip_steps=1)
    assert [r.nodes for r in rows] == [1, 2]
    assert rows[0].samples_per_s == pytest.approx(160 / 6.0)  # steps 1-3: 160 samples in 6 s
    assert rows[1].samples_per_s == pytest.approx(64.0)
    md = (tmp_path / "report" / "scaling.md").read_text()
    assert "| 26.7 |" in md and "| 64.0 |" in md and "trained no sample" not in md


def test_a_run_that_trained_nothing_is_named_in_the_report_and_on_stderr(tmp_path, capsys):
    write_run(tmp_path, "nodes_1", 1, [64, 64, 64], step_s=2.0)
    write_run(tmp_path, "nodes_2", 2, [0, 0, 0], step_s=1.0)  # every group degenerate and dropped
    out = tmp_path / "report"
    assert scaling_report.main([str(tmp_path / "nodes_1"), str(tmp_path / "nodes_2"), "--out", str(out)]) == 0
    warning = "nodes_2: its 2 steady steps trained no sample"
    assert warning in capsys.readouterr().err
    md = (out / "scaling.md").read_text()
    assert warning in md and "nodes_1: its" not in md
    assert json.loads((out / "scaling.json").read_text())[1]["samples_per_s"] == 0.0


def test_metrics_without_sample_counts_leave_the_column_empty(tmp_path):
    run = write_run(tmp_path, "nodes_1", 1, [8, 8], step_s=1.0)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        r.pop("samples_selected", None)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (row,) = scaling_report.build_report([run], tmp_path / "report")
    assert row.samples_per_s is None
    assert "| - |" in (tmp_path / "report" / "scaling.md").read_text()
