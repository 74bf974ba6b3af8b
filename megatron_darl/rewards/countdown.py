"""The countdown verifier: is a response a correct worked chain from the numbers to the target?

A response scores 1.0 when every non-blank line is ``a op b=c`` (``op`` in ``+ - *``, integers,
spaces allowed), ``a`` and ``b`` are still available (the prompt's numbers and earlier results,
each usable once), ``c`` is the exact result, every number ends up used, and the one value left
is the target. Anything else scores 0.0, with the first reason from ``check_chain`` (for tests
and for reading samples). The checker never evaluates text as code, so any string is safe.
The generator of the problems is ``megatron_darl.data.countdown``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

from megatron_darl.data.records import PromptRecord

_LINE = re.compile(r"\s*(-?\d{1,9})\s*([-+*])\s*(-?\d{1,9})\s*=\s*(-?\d{1,12})\s*")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def check_chain(response: str, numbers: Sequence[int], target: int) -> str:
    """``""`` when ``response`` is a correct chain from ``numbers`` to ``target``, else why not."""
    pool = Counter(int(n) for n in numbers)
    lines = [ln for ln in response.strip().splitlines() if ln.strip()]
    if not lines:
        return "empty response"
    for no, line in enumerate(lines, 1):
        match = _LINE.fullmatch(line)
        if match is None:
            return f"line {no} is not 'a op b=c': {line[:40]!r}"
        a, op, b, c = int(match[1]), match[2], int(match[3]), int(match[4])
        need = Counter([a, b])
        if any(pool[v] < k for v, k in need.items()):
            return f"line {no} uses a number that is not available: {line.strip()!r}"
        if _APPLY[op](a, b) != c:
            return f"line {no} is wrong arithmetic: {line.strip()!r}"
        pool -= need
        pool[c] += 1
    left = sorted(pool.elements())
    if len(left) != 1:
        return f"numbers left unused: {left}"
    if left[0] != target:
        return f"reaches {left[0]}, not the target {target}"
    return ""


def countdown_reward(response: str, numbers: Sequence[int], target: int) -> float:
    """1.0 for a correct chain from ``numbers`` to ``target``, else 0.0."""
    return 1.0 if not check_chain(response, numbers, target) else 0.0


def record_reward(record: PromptRecord, response: str) -> float:
    """``countdown_reward`` of a record (numbers in ``metadata["numbers"]``, target in ``reference``).

    Raises:
        ValueError: the record has no numbers or no integer target (names the record).
    """
    numbers = record.metadata.get("numbers")
    try:
        target = int(record.reference)
        numbers = [int(n) for n in numbers]
    except (TypeError, ValueError):
        raise ValueError(f"countdown record {record.prompt_id}: needs metadata['numbers'] (integers) "
                         f"and an integer reference, got {numbers!r} and {record.reference!r}") from None
    if len(numbers) < 2:
        raise ValueError(f"countdown record {record.prompt_id}: needs at least 2 numbers, got {numbers}")
    return countdown_reward(response, numbers, target)
