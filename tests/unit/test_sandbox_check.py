"""The function-check harness (values cross as plain data, exceptions keep their built-in type,
the verdict is the trusted test's), the stdio time budget, and the seccomp filter's syscall
table against the kernel headers."""

import math
import re
import sys
from pathlib import Path

import pytest

from megatron_darl.rewards.code_exec import stdio_reward_with
from megatron_darl.rewards.config import CodeRewardConfig
from megatron_darl.rewards.sandbox import FunctionCheck, SandboxConfig, run_sandboxed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron_darl" / "rewards"))
import sandbox_harness  # noqa: E402
import sandbox_seccomp  # noqa: E402

FAST = SandboxConfig(wall_seconds=4.0, cpu_seconds=3)


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 10 ** 40, 1.5, "x\ny", [1, [2, "3"]], (1, (2,)), {1, 2}, frozenset({"a"}),
    {"a": 1, 2: [3], (4, 5): None}, b"\x00\xff", complex(1, -2), [], (), {},
])
def test_codec_round_trips_plain_values_with_their_types(value):
    back = sandbox_harness.decode(sandbox_harness.encode(value))
    assert back == value and type(back) is type(value)


def test_codec_keeps_special_floats_and_refuses_everything_else():
    back = sandbox_harness.decode(sandbox_harness.encode([math.inf, -math.inf, math.nan]))
    assert back[:2] == [math.inf, -math.inf] and math.isnan(back[2])

    class Sneaky(int):
        def __eq__(self, other):
            return True

    for bad in (Sneaky(1), iter([1]), object(), print):
        with pytest.raises(TypeError):
            sandbox_harness.encode(bad)
    for bad in ({"evil": 1}, {"tuple": 1}, {"dict": [[1]]}, {"a": 1, "b": 2}):
        with pytest.raises(ValueError):
            sandbox_harness.decode(bad)


SETUP = "import math\n\ndef helper(x):\n    return x * 2\n\ndef solve(x):\n    \"\"\"stub\"\"\"\n"
TEST = """
def check(candidate):
    assert candidate(2) == helper(2) + 1
    assert candidate((1, 2)) == (1, 2, 1)
    assert candidate({3}) == {3, 1}
    assert solve(5) == 11  # by name, as HumanEval/33 does
    try:
        candidate("boom")
    except ValueError as exc:
        assert "boom" in str(exc)
    else:
        raise AssertionError("no ValueError")
"""
RIGHT = """
def solve(x):
    if x == "boom":
        raise ValueError("boom!")
    if isinstance(x, tuple):
        return x + (1,)
    if isinstance(x, set):
        return x | {1}
    return helper(x) + 1
"""


def _check(program: str) -> object:
    return run_sandboxed(SETUP + program, "", FAST, FunctionCheck(SETUP, TEST, "solve"))


def test_check_passes_a_right_program_and_reports_why_a_wrong_one_fails():
    right = _check(RIGHT)
    assert right.passed is True and right.ok, right
    wrong = _check(RIGHT.replace("x + (1,)", "list(x) + [1]"))
    assert wrong.passed is False and not wrong.ok
    assert "AssertionError" in wrong.check_error and "<test>" in wrong.check_error


def test_check_fails_on_unencodable_results_missing_functions_and_crashes():
    assert _check("def solve(x):\n    return iter([x])\n").passed is False
    missing = run_sandboxed("def other(x):\n    return x\n", "", FAST, FunctionCheck(SETUP, TEST, "solve"))
    assert missing.passed is False and "KeyError" in missing.check_error
    crash = _check("raise RuntimeError('at import')\n")
    assert crash.passed is False and "exited before answering" in crash.check_error
    assert "RuntimeError: at import" in crash.stderr


def test_program_output_is_kept_after_the_verdict():
    result = _check(RIGHT + "print('hello from the program')\n")
    assert result.passed and result.stdout == "hello from the program\n"


def test_stdio_budget_is_validated_and_bounds_all_cases():
    with pytest.raises(ValueError, match="stdio_total_seconds"):
        CodeRewardConfig(stdio_total_seconds=0)
    cases = [{"input": "1", "output": "1"}] * 3
    cfg = CodeRewardConfig(sandbox=FAST, stdio_scoring="fraction", stdio_total_seconds=30.0)
    assert stdio_reward_with("print(input())", cases, cfg) == 1.0


def _header_numbers(path: str, pattern: str) -> dict[str, int]:
    text = Path(path).read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(pattern, text)}


@pytest.mark.parametrize("col, header, pattern", [
    (0, "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", r"#define __NR_(\w+)\s+(\d+)"),
    (1, "/usr/include/asm-generic/unistd.h", r"#define __NR(?:3264)?_(\w+)\s+(\d+)"),
])
def test_seccomp_syscall_numbers_match_the_kernel_headers(col, header, pattern):
    if not Path(header).is_file():
        pytest.skip(f"{header} not installed")
    known = _header_numbers(header, pattern)
    checked = 0
    for name, numbers in sandbox_seccomp._SYSCALLS.items():
        if numbers[col] is not None and name in known:
            assert numbers[col] == known[name], name
            checked += 1
        elif name in known:
            pytest.fail(f"{name} exists in {header} but the table says it does not")
    assert checked >= 70  # the rest are newer than these headers


def test_seccomp_filters_fit_bpf_limits():
    for degraded in (False, True):
        base = sandbox_seccomp.base_filter(degraded)
        prog = sandbox_seccomp.program_filter(2, degraded)
        assert len(base) % 8 == 0 and 8 < len(base) // 8 < 4096
        assert len(prog) % 8 == 0 and 8 < len(prog) // 8 < 4096
    assert set(sandbox_seccomp.DENIED) <= set(sandbox_seccomp._SYSCALLS)
