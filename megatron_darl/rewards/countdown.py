"""The countdown verifier: is a response a correct worked chain from the numbers to the target?

A response scores 1.0 when every non-blank line is ``a op b=c`` (``op`` in ``+ - *``, integers,
spaces allowed), ``a`` and ``b`` are still available (the prompt's numbers and earlier results,
each usable once), ``c`` is the exact result, every number ends up used, and the one value left
is the target. A valid chain that ends elsewhere scores ``valid_chain_reward`` (0.0 unless the
dataset asks for partial credit, ``countdown.valid_chain_reward``); anything else scores 0.0.
``check_chain`` gives the first reason (for tests and for reading samples). The checker never
evaluates text as code, so any string is safe. The generator is ``megatron_darl.data.countdown``.

Why partial credit exists: with a binary reward, a tiny policy's RL updates (about one success in
ten samples) unlearn the line arithmetic its warm start taught faster than they teach the search
(measured: valid chains 77% -> 38% in 100 steps at lr 2e-4, while the hit rate among valid
chains rose 6% -> 17%). A small reward for a valid chain keeps the format in the objective, as
the format rewards of R1-style training do; held-out accuracy is always scored without it.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

from megatron_darl.data.records import PromptRecord

_LINE = re.compile(r"\s*(-?\d{1,9})\s*([-+*])\s*(-?\d{1,9})\s*=\s*(-?\d{1,12})\s*")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
MISSED = "reaches "  # check_chain's reason for a valid chain that ends off the target


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
        return f"{MISSED}{left[0]}, not the target {target}"
    return ""


def countdown_reward(response: str, numbers: Sequence[int], target: int,
                     valid_chain_reward: float = 0.0) -> float:
    """1.0 for a correct chain from ``numbers`` to ``target``, ``valid_chain_reward`` for a
    valid chain that misses the target, else 0.0."""
    why = check_chain(response, numbers, target)
    return 1.0 if not why else valid_chain_reward if why.startswith(MISSED) else 0.0


def record_reward(record: PromptRecord, response: str) -> float:
    """``countdown_reward`` of a record (numbers in ``metadata["numbers"]``, target in ``reference``,
    partial credit in ``metadata["valid_chain_reward"]``, default 0).

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
    partial = float(record.metadata.get("valid_chain_reward", 0.0))
    return countdown_reward(response, numbers, target, partial)
