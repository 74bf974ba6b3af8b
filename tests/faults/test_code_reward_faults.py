"""Code rewards that were silently 0: HumanEval-style rows the check could not run.

A row whose prompt is a bare signature (``def add(a, b):``, the completion being the body) made
the check run the prompt as setup code, hit an IndentationError and score the correct answer 0,
so a dataset like that trained on all-zero rewards without a word. Rows are real jsonl files
read by the real loader (``configs/data/humaneval.yaml``), answers are scored by the real reward
function in the real sandbox, and errors are read from the real counter the loop reports.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_darl import counters
from megatron_darl.data.config import load_data_config
from megatron_darl.data.loaders import MalformedRowError, load_records
from megatron_darl.data.records import PromptRecord
from megatron_darl.rewards.registry import get_reward_fn

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("DARL_BENCHMARK_DIR", REPO.parent / "shared" / "data" / "benchmarks"))
PRESET = REPO / "configs" / "data" / "humaneval.yaml"
TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-4, 4) == 0\n"
BARE_ROWS = [  # (prompt, the body that completes it)
    ("def add(a, b):\n", '    """Add a and b."""\n    return a + b\n'),
    ('def add(a, b):\n    """Add a and b."""', "\n    return a + b\n"),
    ("import math\n\n\ndef add(a, b):\n    # add a and b\n", "    return math.fsum([a, b])\n"),
]
FENCED = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(path: Path, **overrides):
    return load_records(load_data_config(PRESET, {"path": str(path), **overrides}))


def _errors() -> int:
    return counters.snapshot().get(counters.REWARD_ERRORS, 0)


@pytest.mark.fault(kind="input", name="HumanEval rows with a bare-signature prompt")
def test_bare_signature_rows_score_their_correct_answers(tmp_path, fault_record):
    """A correct body or fenced function scores 1 on every bare-signature row (2 of 3 scored 0), a wrong one 0, with no reward error."""
    path = _write_rows(tmp_path / "bare.jsonl", [
        {"task_id": f"bare/{i}", "prompt": p, "test": TEST, "entry_point": "add"}
        for i, (p, _) in enumerate(BARE_ROWS)])
    records = _load(path).records
    reward, before = get_reward_fn("humaneval"), _errors()
    body = [reward(r, completion) for r, (_, completion) in zip(records, BARE_ROWS)]
    fenced = [reward(r, FENCED) for r in records]
    wrong = [reward(r, completion.replace("a + b", "a - b").replace("[a, b]", "[a, -b]"))
             for r, (_, completion) in zip(records, BARE_ROWS)]
    assert (body, fenced, wrong) == ([1.0] * 3, [1.0] * 3, [0.0] * 3)
    assert _errors() == before
    fault_record["observed"] = "correct bodies 1,1,1; fenced functions 1,1,1; wrong bodies 0,0,0; reward_errors +0"


@pytest.mark.fault(kind="input", name="HumanEval row whose check cannot run")
def test_a_row_the_check_cannot_run_is_a_counted_error_not_a_silent_zero(tmp_path, caplog, fault_record):
    """A row with broken test code is refused at load naming file, line and field; one that fails only in the sandbox scores 0.0, logged and counted in reward_errors."""
    good = {"task_id": "ok/0", "prompt": BARE_ROWS[0][0], "test": TEST, "entry_point": "add"}
    bad = [dict(good, task_id="bad/1", test=TEST.replace("check", "verify")),
           dict(good, task_id="bad/2", test="def check(candidate):\nassert candidate(1, 2) == 3\n"),
           dict(good, task_id="bad/3", prompt="from typing import List\nimport (\n\ndef add(a, b):\n"),
           dict(good, task_id="bad/4", entry_point="add two")]
    path = _write_rows(tmp_path / "rows.jsonl", [good] + bad)
    with pytest.raises(MalformedRowError) as err:
        _load(path)
    assert str(err.value).startswith(f"{path}:2: field 'test': test code defines no check"), err.value
    loaded = _load(path, skip_malformed=True)
    assert [r.metadata["source_id"] for r in loaded.records] == ["ok/0"]
    assert loaded.skipped_lines == [2, 3, 4, 5]

    # What no load-time check can see: the check's own code fails only when run in the sandbox
    # (a module the sandbox lacks, a test that raises before calling the program).
    reward, before = get_reward_fn("humaneval"), _errors()
    rows = [PromptRecord(0, "import a_module_the_sandbox_lacks\n\n" + good["prompt"], [], "humaneval",
                         reference=TEST, metadata={"entry_point": "add", "source_id": "runtime/1"}),
            PromptRecord(1, good["prompt"], [], "humaneval", reference="1 / 0\n" + TEST,
                         metadata={"entry_point": "add", "source_id": "runtime/2"}),
            PromptRecord(2, good["prompt"], [], "humaneval", reference=TEST,
                         metadata={"entry_point": "", "source_id": "runtime/3"})]
    with caplog.at_level(logging.ERROR, logger="megatron_darl.rewards.code_exec"):
        scores = [reward(r, BARE_ROWS[0][1]) for r in rows]
    assert scores == [0.0, 0.0, 0.0]
    assert _errors() == before + 3
    logged = [m for m in caplog.messages if m.startswith("reward error")]
    assert len(logged) == 3 and all(f"runtime/{i}" in m for i, m in enumerate(logged, 1)), logged
    assert "ModuleNotFoundError" in logged[0] and "ZeroDivisionError" in logged[1], logged
    fault_record["observed"] = f"load: '{str(err.value).replace(str(tmp_path), '<tmp>')[:120]}'; run time: 3 x 0.0, reward_errors +3"
    fault_record["lost"] = "the rows that cannot be scored (named, counted)"


def _bare(problem: dict) -> tuple[str, str] | None:
    """A real HumanEval row rewritten as a bare signature: (prompt up to the docstring, the
    docstring + canonical body), or None when its prompt has no docstring after the stub."""
    stub = re.search(rf"^def {re.escape(problem['entry_point'])}\(", problem["prompt"], re.M)
    doc = re.compile(r'^[ \t]+(?:"""|\'\'\')', re.M).search(problem["prompt"], stub.end())
    if doc is None:
        return None
    cut = doc.start()
    return problem["prompt"][:cut], problem["prompt"][cut:] + problem["canonical_solution"]


@pytest.mark.fault(kind="input", name="HumanEval canonical solutions, as stored and as bare signatures")
def test_canonical_solutions_score_one_on_real_rows(fault_record):
    """The honest control: every real HumanEval row loads, and canonical solutions score 1 on the rows as stored and rewritten to bare signatures."""
    path = BENCH / "humaneval" / "HumanEval.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"benchmark file {path} not present (set DARL_BENCHMARK_DIR)")
    with gzip.open(path, "rt") as f:
        problems = {p["task_id"]: p for p in map(json.loads, f)}
    records = _load(path).records
    assert len(records) == len(problems) == 164
    sample = records[::8]  # 21 rows: every loaded row was vetted; a sample is run (2 CPU cores)
    reward, before = get_reward_fn("humaneval"), _errors()
    runs = []
    for r in sample:
        p = problems[r.metadata["source_id"]]
        runs.append((r, p["canonical_solution"]))
        bare = _bare(p)
        if bare is not None:
            runs.append((PromptRecord(r.prompt_id, bare[0], [], "humaneval", r.reference, [], r.metadata), bare[1]))
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda run: reward(*run), runs))
    failed = [(r.metadata["source_id"], r.prompt[-40:]) for (r, _), s in zip(runs, scores) if s != 1.0]
    assert not failed and len(runs) == 2 * len(sample), failed
    assert _errors() == before
    fault_record["observed"] = f"164 rows loaded; {len(runs)} canonical runs on {len(sample)} rows (stored and bare) all 1.0"
