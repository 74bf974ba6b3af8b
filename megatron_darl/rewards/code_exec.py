"""Code rewards: run a model's program against tests in the sandbox.

Two formats cover the code benchmarks we train and evaluate on:

- HumanEval: a function completion, checked by the record's ``check(candidate)`` test code.
  The test runs in the sandbox's harness process and calls the program's function across a
  pipe (``sandbox.FunctionCheck``), so the reward is the harness's verdict: a wrong solution
  that exits early with status 0, registers atexit hooks or prints "passed" scores 0;
- stdin/stdout cases (LiveCodeBench, Codeforces style): a full program fed each case's input,
  its output compared to the expected one token by token (whitespace-tolerant), scored as the
  fraction of cases passed or all-or-nothing. All cases of one answer share a time budget
  (``stdio_total_seconds``) on top of the per-run wall-clock limit.

Models often wrap code in a markdown fence; the last fenced block is taken when there is one.

A row the check cannot run on (its test or prompt code broken, the sandbox failing) is not the
answer's fault: it scores 0.0 and is logged and counted (``reward_errors`` in the trainer's
metrics), so a dataset that cannot be scored shows up at once instead of training on zeros.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

from megatron_darl import counters
from megatron_darl.data.testcases import humaneval_setup, humaneval_solution_prefix
from megatron_darl.rewards.config import CodeRewardConfig
from megatron_darl.rewards.sandbox import FunctionCheck, SandboxResult, run_sandboxed

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> tuple[str, bool]:
    """(code, fenced): the last fenced code block of ``text``, or ``text`` itself when unfenced."""
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1], True
    return text, False


def _humaneval_fields(problem: dict) -> None:
    for key in ("prompt", "test", "entry_point"):
        if key not in problem:
            raise ValueError(f"HumanEval problem {problem.get('task_id', '?')} has no field {key!r}")


def humaneval_solution(problem: dict, completion: str) -> str:
    """The program defining the completed function (what the sandbox runs as ``__main__``).

    An unfenced completion continues the prompt, as the benchmark defines it (prompt +
    completion: the body of the prompted function). A fenced one that defines the entry point
    replaces the prompt's stub (it follows the prompt's code before the stub: imports, helpers);
    any other fenced block is appended to the prompt.
    """
    _humaneval_fields(problem)
    code, fenced = extract_code(completion)
    if not fenced:
        return problem["prompt"] + code + "\n"
    entry = re.escape(str(problem["entry_point"]))
    if re.search(rf"^(?:async[ \t]+)?def[ \t]+{entry}[ \t]*\(", code, re.M):
        return humaneval_solution_prefix(problem["prompt"], problem["entry_point"]) + "\n" + code + "\n"
    return problem["prompt"] + "\n" + code + "\n"


def humaneval_program(problem: dict, completion: str) -> str:
    """The completed function and the record's tests as one program, as the benchmark runs it
    (for reading and debugging; rewards run the tests in the harness, see ``humaneval_reward``)."""
    body = humaneval_solution(problem, completion)
    return f"{body}\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def reward_error(what: str) -> float:
    """0.0 for a row the verifier could not score, logged and counted (``reward_errors``)."""
    total = counters.count(counters.REWARD_ERRORS)
    logger.error("reward error %d (scored 0.0): %s", total, what)
    return 0.0


def _verifier_failure(result: SandboxResult) -> str:
    """Why the run says nothing about the answer (the sandbox or the trusted check failed)."""
    return result.error or result.harness_error


def humaneval_reward_with(problem: dict, completion: str, cfg: CodeRewardConfig) -> float:
    """``humaneval_reward`` under explicit limits."""
    program = humaneval_solution(problem, completion)
    name = f"HumanEval row {problem.get('task_id', '?')}"
    try:
        setup = humaneval_setup(problem["prompt"], problem["test"], problem["entry_point"])
    except ValueError as exc:
        return reward_error(f"{name}: field {getattr(exc, 'part', '?')!r}: {exc}")
    check = FunctionCheck(setup=setup, test=problem["test"], entry_point=problem["entry_point"])
    result = run_sandboxed(program, "", cfg.sandbox, check)
    if _verifier_failure(result):
        return reward_error(f"{name}: {_verifier_failure(result)}")
    return 1.0 if result.ok else 0.0


def humaneval_reward(problem: dict, completion: str) -> float:
    """1.0 when ``completion`` passes the HumanEval record's ``check`` in the sandbox, else 0.0.

    The record's prompt and ``check`` run in the sandbox's harness (trusted code); ``check``
    gets a proxy that calls the completed function in the program's process, so only the
    values it returns count, never its exit status or output.

    Args:
        problem: a HumanEval-format record with ``prompt``, ``test`` and ``entry_point``.
        completion: the model's continuation of the prompt (body only) or a fenced full function.
    """
    return humaneval_reward_with(problem, completion, _DEFAULT)


def outputs_match(actual: str, expected: str) -> bool:
    """Whitespace-tolerant comparison: same tokens in the same order, any spacing or newlines."""
    return actual.split() == expected.split()


def stdio_reward_with(code: str, cases: list[dict], cfg: CodeRewardConfig) -> float:
    """``stdio_reward`` under explicit limits and scoring.

    Cases run one after another, each under ``cfg.sandbox.wall_seconds`` and all together
    under ``cfg.stdio_total_seconds``: a case that would start past that budget, or gets cut
    by it, fails.
    """
    if not cases:
        raise ValueError("stdio_reward: no test cases given")
    for i, case in enumerate(cases):
        if "input" not in case or "output" not in case:
            raise ValueError(f"stdio_reward: case {i} needs 'input' and 'output', got {sorted(case)}")
    program, _ = extract_code(code)
    deadline = time.monotonic() + cfg.stdio_total_seconds
    passed = 0
    for i, case in enumerate(cases):
        left = deadline - time.monotonic()
        if left > 0:
            limits = dataclasses.replace(cfg.sandbox, wall_seconds=min(cfg.sandbox.wall_seconds, left))
            result = run_sandboxed(program, case["input"], limits)
            if _verifier_failure(result):
                return reward_error(f"stdio case {i} of {len(cases)}: {_verifier_failure(result)}")
            if result.ok and outputs_match(result.stdout, case["output"]):
                passed += 1
                continue
        if cfg.stdio_scoring == "all" or left <= 0:
            break  # no need to run the rest (or no time left for them)
    if cfg.stdio_scoring == "fraction":
        return passed / len(cases)
    return 1.0 if passed == len(cases) else 0.0


def stdio_reward(code: str, cases: list[dict]) -> float:
    """Score a stdin/stdout program: 1.0 when every case's output matches, else 0.0.

    Args:
        code: the model's program (the last fenced block is taken when fenced).
        cases: ``[{"input": str, "output": str}, ...]``; outputs compare token by token.
    """
    return stdio_reward_with(code, cases, _DEFAULT)


_DEFAULT = CodeRewardConfig()
