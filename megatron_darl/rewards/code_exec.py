"""Code rewards: run a model's program against tests in the sandbox.

Two formats cover the code benchmarks we train and evaluate on:

- HumanEval: a function completion, checked by the record's ``check(candidate)`` test code;
- stdin/stdout cases (LiveCodeBench, Codeforces style): a full program fed each case's input,
  its output compared to the expected one token by token (whitespace-tolerant), scored as the
  fraction of cases passed or all-or-nothing.

Models often wrap code in a markdown fence; the last fenced block is taken when there is one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_darl.rewards.sandbox import SandboxConfig, run_sandboxed

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclass
class CodeRewardConfig:
    """How code answers are scored."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # limits of each run
    stdio_scoring: str = "all"  # "all": 1.0 only when every case passes; "fraction": share passed

    def __post_init__(self) -> None:
        if self.stdio_scoring not in ("all", "fraction"):
            raise ValueError(f"CodeRewardConfig.stdio_scoring={self.stdio_scoring!r}: use 'all' or 'fraction'")


def extract_code(text: str) -> tuple[str, bool]:
    """(code, fenced): the last fenced code block of ``text``, or ``text`` itself when unfenced."""
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1], True
    return text, False


def humaneval_program(problem: dict, completion: str) -> str:
    """The program that checks ``completion`` against a HumanEval record's tests.

    An unfenced completion continues the prompt (the benchmark's own convention: the body of
    the prompted function); a fenced one is a whole definition appended after the prompt, so
    it replaces the prompted stub while keeping the prompt's imports.
    """
    for key in ("prompt", "test", "entry_point"):
        if key not in problem:
            raise ValueError(f"HumanEval problem {problem.get('task_id', '?')} has no field {key!r}")
    code, fenced = extract_code(completion)
    body = problem["prompt"] + ("\n" + code if fenced else code)
    return f"{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def humaneval_reward_with(problem: dict, completion: str, cfg: CodeRewardConfig) -> float:
    """``humaneval_reward`` under explicit limits."""
    return 1.0 if run_sandboxed(humaneval_program(problem, completion), "", cfg.sandbox).ok else 0.0


def humaneval_reward(problem: dict, completion: str) -> float:
    """1.0 when ``completion`` passes the HumanEval record's ``check`` in the sandbox, else 0.0.

    Args:
        problem: a HumanEval-format record with ``prompt``, ``test`` and ``entry_point``.
        completion: the model's continuation of the prompt (body only) or a fenced full function.
    """
    return humaneval_reward_with(problem, completion, _DEFAULT)


def outputs_match(actual: str, expected: str) -> bool:
    """Whitespace-tolerant comparison: same tokens in the same order, any spacing or newlines."""
    return actual.split() == expected.split()


def stdio_reward_with(code: str, cases: list[dict], cfg: CodeRewardConfig) -> float:
    """``stdio_reward`` under explicit limits and scoring."""
    if not cases:
        raise ValueError("stdio_reward: no test cases given")
    program, _ = extract_code(code)
    passed = 0
    for i, case in enumerate(cases):
        if "input" not in case or "output" not in case:
            raise ValueError(f"stdio_reward: case {i} needs 'input' and 'output', got {sorted(case)}")
        result = run_sandboxed(program, case["input"], cfg.sandbox)
        if result.ok and outputs_match(result.stdout, case["output"]):
            passed += 1
        elif cfg.stdio_scoring == "all":
            return 0.0  # no need to run the rest
    return passed / len(cases) if cfg.stdio_scoring == "fraction" else 1.0


def stdio_reward(code: str, cases: list[dict]) -> float:
    """Score a stdin/stdout program: 1.0 when every case's output matches, else 0.0.

    Args:
        code: the model's program (the last fenced block is taken when fenced).
        cases: ``[{"input": str, "output": str}, ...]``; outputs compare token by token.
    """
    return stdio_reward_with(code, cases, _DEFAULT)


_DEFAULT = CodeRewardConfig()
