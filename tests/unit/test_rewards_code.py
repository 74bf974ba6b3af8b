"""Code rewards: every HumanEval canonical solution passes and an empty body fails; stdin/stdout
scoring is whitespace-tolerant with fraction or all-pass scoring; the registry dispatches."""

import gzip
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_darl.data.records import PromptRecord
from megatron_darl.rewards import (
    CodeRewardConfig,
    Task,
    extract_code,
    get_reward_fn,
    humaneval_reward,
    stdio_reward,
)
from megatron_darl.rewards.code_exec import humaneval_program, outputs_match, stdio_reward_with

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("DARL_BENCHMARK_DIR", REPO.parent / "shared" / "data" / "benchmarks"))


@pytest.fixture(scope="module")
def humaneval():
    path = BENCH / "humaneval" / "HumanEval.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"benchmark file {path} not present (set DARL_BENCHMARK_DIR)")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _scores(problems, completions):
    with ThreadPoolExecutor(4) as pool:  # each run is a subprocess: threads suffice
        return list(pool.map(humaneval_reward, problems, completions))


def test_every_canonical_solution_passes(humaneval):
    scores = _scores(humaneval, [p["canonical_solution"] for p in humaneval])
    failed = [p["task_id"] for p, s in zip(humaneval, scores) if s != 1.0]
    assert len(humaneval) == 164 and not failed, f"canonical solutions failed: {failed}"


def test_every_empty_body_fails(humaneval):
    scores = _scores(humaneval, ["" for _ in humaneval])
    passed = [p["task_id"] for p, s in zip(humaneval, scores) if s != 0.0]
    assert not passed, f"empty bodies passed: {passed}"


def test_fenced_full_function_is_accepted(humaneval):
    problem = humaneval[0]
    fenced = f"Here you go:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\nDone."
    assert humaneval_reward(problem, fenced) == 1.0
    wrong = f"```python\ndef {problem['entry_point']}(numbers, threshold):\n    return True\n```"
    assert humaneval_reward(problem, wrong) == 0.0


def test_humaneval_record_through_registry(humaneval):
    p = humaneval[2]
    record = PromptRecord(0, p["prompt"], [], "humaneval", reference=p["test"],
                          metadata={"entry_point": p["entry_point"]})
    fn = get_reward_fn("humaneval")
    assert fn(record, p["canonical_solution"]) == 1.0
    assert fn(record, "    return 0.0\n") == 0.0


def test_humaneval_problem_missing_field_is_an_error():
    with pytest.raises(ValueError, match="entry_point"):
        humaneval_program({"prompt": "def f():\n", "test": ""}, "    pass")


ECHO_SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 20", "output": "30"},
         {"input": "5 5\n", "output": "11\n"}]  # the last one is wrong on purpose


def test_stdio_all_pass_and_fraction_scoring():
    assert stdio_reward(ECHO_SUM, CASES[:2]) == 1.0
    assert stdio_reward(ECHO_SUM, CASES) == 0.0
    frac = stdio_reward_with(ECHO_SUM, CASES, CodeRewardConfig(stdio_scoring="fraction"))
    assert frac == pytest.approx(2 / 3)


def test_stdio_comparison_is_whitespace_tolerant():
    assert outputs_match("1  2\n3\n\n", "1 2 3")
    assert not outputs_match("1 2", "12")
    code = "```python\nprint(' 1   2 ')\nprint()\nprint('3')\n```"
    assert stdio_reward(code, [{"input": "", "output": "1 2\n3"}]) == 1.0


def test_stdio_crash_and_bad_cases():
    assert stdio_reward("raise SystemExit(3)", [{"input": "", "output": ""}]) == 0.0
    with pytest.raises(ValueError, match="no test cases"):
        stdio_reward(ECHO_SUM, [])
    with pytest.raises(ValueError, match="case 0"):
        stdio_reward(ECHO_SUM, [{"stdin": "1 2"}])
    with pytest.raises(ValueError, match="stdio_scoring"):
        CodeRewardConfig(stdio_scoring="most")


def test_extract_code_takes_last_fence_or_whole_text():
    assert extract_code("a\n```python\nx=1\n```\nb\n```py\ny=2\n```") == ("y=2\n", True)
    assert extract_code("print(1)") == ("print(1)", False)
    assert extract_code("```python\nprint(1)")[0] == "print(1)"  # unterminated fence


def test_registry_covers_every_task_and_rejects_unknown():
    assert {t.value for t in Task} == {"math", "gsm8k", "humaneval", "stdio", "builtin", "countdown"}
    record = PromptRecord(0, "", [], "stdio", tests=CASES[:1])
    assert get_reward_fn("stdio")(record, ECHO_SUM) == 1.0
    gsm = PromptRecord(0, "", [], "gsm8k", reference="3 + 4 = 7\n#### 7")
    assert get_reward_fn("gsm8k")(gsm, "so \\boxed{7}") == 1.0
    assert get_reward_fn("math")(gsm, "#### 8") == 0.0
    with pytest.raises(ValueError, match="unknown reward task"):
        get_reward_fn("chess")
