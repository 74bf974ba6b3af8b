"""tools/prepare_data.py puts the benchmarks where the presets read them and checks every file
(SHA-256 and rows), by download (here from a file:// mirror of the raw-file layout, built from
the shared copy) or from a local copy; evaluation takes a limit as a count or a fraction."""

import json
import shutil
from pathlib import Path

import pytest

from megatron_darl.data.config import load_data_config
from megatron_darl.data.locations import SHARED_BENCHMARKS
from megatron_darl.eval.config import EvalConfig
from megatron_darl.eval.harness import take_limit
from tools import prepare_data as pd

REPO = Path(__file__).resolve().parents[2]
needs_copy = pytest.mark.skipif(not (SHARED_BENCHMARKS / "aime24" / "test.jsonl").is_file(),
                                reason=f"no local copy of the benchmarks at {SHARED_BENCHMARKS}")


def _mirror(root: Path, names) -> str:
    """A raw.githubusercontent-like tree ({repo}/{commit}/{path}) holding the shared files."""
    for name in names:
        for src in pd.SOURCES[name]:
            dest = root / src.repo / src.commit / src.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(SHARED_BENCHMARKS / src.file, dest)
    return root.as_uri()


@needs_copy
def test_download_checks_and_lands_where_the_presets_read(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench"
    mirror = _mirror(tmp_path / "mirror", ["aime24", "humaneval"])
    assert pd.main(["aime24", "humaneval", "--out", str(out), "--mirror", mirror]) == 0
    said = capsys.readouterr()
    assert "aime24/test.jsonl: downloaded from file://" in said.out
    assert "license text not fetched" in said.err  # the mirror has no LICENSE: a warning, not a failure
    manifest = {e["file"]: e for e in json.loads((out / "MANIFEST.json").read_text())}
    assert manifest["aime24/test.jsonl"]["rows"] == 30 and manifest["humaneval/HumanEval.jsonl.gz"]["rows"] == 164
    monkeypatch.setenv("DARL_BENCHMARK_DIR", str(out))
    data = load_data_config(REPO / "configs/data/aime.yaml")
    assert data.path == str(out / "aime24/test.jsonl")
    # a second run keeps what is there; a damaged file is refused, naming it, until --force
    assert pd.main(["aime24", "--out", str(out), "--mirror", mirror]) == 0
    assert "kept (already there, checksum ok)" in capsys.readouterr().out
    (out / "aime24/test.jsonl").write_text('{"id": 1}\n')
    assert pd.main(["aime24", "--out", str(out), "--mirror", mirror]) == 1
    assert "aime24/test.jsonl: sha256" in capsys.readouterr().err
    assert pd.main(["aime24", "--out", str(out), "--mirror", mirror, "--force"]) == 0
    pd.check_file(out / "aime24/test.jsonl", pd.SOURCES["aime24"][0])


@needs_copy
def test_offline_copy_is_checked_and_a_bad_copy_refused(tmp_path, capsys):
    out = tmp_path / "bench"
    assert pd.main(["gsm8k", "math500", "--from", str(SHARED_BENCHMARKS), "--out", str(out)]) == 0
    assert (out / "gsm8k/train.jsonl").stat().st_size == (SHARED_BENCHMARKS / "gsm8k/train.jsonl").stat().st_size
    assert (out / "licenses/openai_grade-school-math_LICENSE").is_file()
    bad = tmp_path / "bad"
    (bad / "math500").mkdir(parents=True)
    lines = (SHARED_BENCHMARKS / "math500/test.jsonl").read_text().splitlines(keepends=True)
    (bad / "math500/test.jsonl").write_text("".join(lines[:-1]))  # one row short
    assert pd.main(["math500", "--from", str(bad), "--out", str(tmp_path / "other")]) == 1
    assert "math500/test.jsonl: sha256" in capsys.readouterr().err
    assert not (tmp_path / "other/math500/test.jsonl").exists()


def test_unreachable_source_says_how_to_work_offline(tmp_path, capsys):
    gone = (tmp_path / "nowhere").as_uri()  # nothing there: the same error as no network
    assert pd.main(["aime24", "--out", str(tmp_path / "b"), "--mirror", gone]) == 1
    err = capsys.readouterr().err
    assert "aime24/test.jsonl" in err and "--from DIR" in err
    assert pd.main(["gsm9k", "--out", str(tmp_path / "b")]) == 2


def test_limit_is_a_count_or_a_fraction():
    rows = list(range(10))
    assert take_limit(rows, -1) == rows and take_limit(rows, 3) == [0, 1, 2]
    assert take_limit(rows, 0.25) == [0, 1, 2] and take_limit(rows, 0.01) == [0]  # rounded up, at least one
    from megatron_darl.eval.config import HeldoutConfig

    for bad in (0, 1.5, -2):
        with pytest.raises(ValueError, match="limit"):
            EvalConfig(limit=bad)
        with pytest.raises(ValueError, match="HeldoutConfig.limit"):
            HeldoutConfig(limit=bad)
    from tools.eval import parse_args

    assert parse_args(["--model", "m", "--limit", "0.1"]).limit == 0.1
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--limit", "2.5"])
