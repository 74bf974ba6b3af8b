"""tools/reliability_report.py: fault records -> docs/reliability.md tables (summary per kind, full list)."""

import json

from tools.reliability_report import load, main


def _record(kind, name, outcome="passed", lost="", test=None):
    return {"kind": kind, "name": name, "must": f"{name} must be handled.", "test": test or f"t::{name}",
            "param": "", "outcome": outcome, "observed": "a | b", "lost": lost or "nothing", "seconds": 1.0}


def test_summary_counts_per_kind_and_later_files_win(tmp_path):
    first = {"date": "2026-01-01T00:00:00", "records": [_record("process", "sigstop", "failed", "unknown"),
                                                        _record("file", "truncated metrics")]}
    second = {"date": "2026-01-02T00:00:00", "records": [_record("process", "sigstop", test="t::sigstop")]}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (first, second)):
        path.write_text(json.dumps(data))
    records, date = load(paths)
    assert len(records) == 2 and date == "2026-01-02T00:00:00"
    out = tmp_path / "reliability.md"
    assert main([*map(str, paths), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| process | 1 | 1 | 0 | 0 | 1 |" in text and "| **all** | 2 | 2 | 0 | 0 | 2 |" in text
    assert "| sigstop | sigstop must be handled. | passed | a \\| b | nothing |" in text


def test_malformed_results_file_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"records": [{"kind": "x"}]}))
    assert main([str(bad), "--out", str(tmp_path / "o.md")]) == 1
    assert str(bad) in capsys.readouterr().err
