"""Stored tests of code rows: stdin/stdout cases decoded, HumanEval check code vetted.

Datasets store stdin/stdout cases as a list, a JSON string, or (LiveCodeBench private tests) a
JSON string that was pickled, zlib-compressed and base64-encoded. The pickle only ever wraps a
string, so it is read with an unpickler that refuses every global: a crafted dataset file cannot
run code.

HumanEval-style rows (a prompt ending in the stub of the function to complete, test code that
defines ``check(candidate)``, an entry point) are checked here at load time, because a row the
check cannot run on scores every answer 0 and trains on nothing: the test must compile and
define ``check``, the entry point must be a name, and the prompt's code before the stub (what
the check runs with: imports, helpers the tests call) must compile. The stub itself (a bare
``def f(a, b):``, with or without a docstring) is the model's to complete and need not compile.
"""

from __future__ import annotations

import ast
import base64
import functools
import io
import json
import pickle
import re
import zlib


class _StringsOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"test case blob references {module}.{name}; refused")


def _decompress_livecodebench(blob: str) -> str:
    raw = zlib.decompress(base64.b64decode(blob.encode("utf-8")))
    value = _StringsOnlyUnpickler(io.BytesIO(raw)).load()
    if not isinstance(value, str):
        raise ValueError(f"compressed test cases decode to {type(value).__name__}, expected str")
    return value


def decode_cases(value, livecodebench: bool = False) -> list[dict[str, str]]:
    """Cases from a stored column; stdin/stdout cases only (LiveCodeBench "functional" dropped).

    Raises:
        ValueError: the value is not a list of cases in any supported encoding.
    """
    if value is None or value == "":
        return []
    if isinstance(value, str):
        text = value.strip()
        if livecodebench and not text.startswith("["):
            text = _decompress_livecodebench(text)
        value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError(f"test cases must be a list, got {type(value).__name__}")
    cases = []
    for i, case in enumerate(value):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise ValueError(f"test case {i} needs 'input' and 'output'")
        if case.get("testtype", "stdin") != "stdin":
            continue
        cases.append({"input": str(case["input"]), "output": str(case["output"])})
    return cases


class FunctionTestError(ValueError):
    """A HumanEval-style row the check cannot run on; ``part`` is the row's part at fault:
    "prompt", "test" or "entry_point"."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(message)
        self.part = part


def _stub_start(prompt: str, entry_point: str) -> int | None:
    """Offset of the entry point's stub in ``prompt`` (its decorators included), or None."""
    match = re.search(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", prompt, re.M)
    if match is None:
        return None
    start = match.start()
    while start > 0:  # decorators directly above the def belong to the stub
        line_start = prompt.rfind("\n", 0, start - 1) + 1
        if not prompt[line_start:start].startswith("@"):
            break
        start = line_start
    return start


def _binds_check(node: ast.stmt) -> bool:
    """Whether a top-level statement of the test code defines ``check``."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == "check"
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == "check" for t in node.targets)
    return False


def _compile_error(code: str, filename: str) -> str:
    try:
        compile(code, filename, "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte in the source
        return f"{type(exc).__name__}: {exc}"
    return ""


def humaneval_setup(prompt: str, test: str, entry_point: str) -> str:
    """The trusted code a HumanEval check runs with, after vetting the row.

    That is the prompt up to the stub of ``entry_point`` (the whole prompt when it has no such
    stub): the check binds the entry point's name to the program's function itself, so the stub,
    which a bare signature leaves without a body, is never run by the check.

    Raises:
        FunctionTestError: the entry point is not a name, the test does not compile or defines
            no ``check``, or the prompt's code before the stub does not compile.
    """
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise FunctionTestError("entry_point", f"entry point {entry_point!r} is not a function name")
    for part, value in (("prompt", prompt), ("test", test)):
        if not isinstance(value, str):
            raise FunctionTestError(part, f"{part} is a {type(value).__name__}, not code")
    return _vetted_setup(prompt, test, entry_point)


@functools.lru_cache(maxsize=4096)  # every answer to a row vets it again: once is enough
def _vetted_setup(prompt: str, test: str, entry_point: str) -> str:
    error = _compile_error(test, "<test>")
    if error:
        raise FunctionTestError("test", f"test code does not compile ({error})")
    tree = ast.parse(test)
    if not any(_binds_check(node) for node in tree.body):
        raise FunctionTestError("test", "test code defines no check(candidate)")
    start = _stub_start(prompt, entry_point)
    setup = prompt if start is None else prompt[:start]
    error = _compile_error(setup, "<prompt>")
    if error:
        where = "the prompt" if start is None else f"the prompt before def {entry_point}"
        raise FunctionTestError("prompt", f"{where} does not compile ({error})")
    return setup


def humaneval_solution_prefix(prompt: str, entry_point: str) -> str:
    """The prompt without the entry point's stub: what a complete definition of the function
    (a fenced answer) is appended to, so that a bodiless stub does not break the program."""
    start = _stub_start(prompt, entry_point)
    return prompt if start is None else prompt[:start]
