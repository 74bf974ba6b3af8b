"""Decoding stored test cases into ``[{"input": str, "output": str}]`` lists.

Datasets store cases as a list, a JSON string, or (LiveCodeBench private tests) a JSON string
that was pickled, zlib-compressed and base64-encoded. The pickle only ever wraps a string, so
it is read with an unpickler that refuses every global: a crafted dataset file cannot run code.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
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
