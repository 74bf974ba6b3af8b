"""The built-in arithmetic task's verifier: exact match on the last ``answer: N``.

The task's prompts, reference solutions and tokenizer are data (``megatron_darl.data.builtin``);
its verifier is a reward like the math and code ones, so it lives here and the reward registry
needs nothing from ``data`` to score it.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"answer:\s*(-?\d+)")


def builtin_reward(response: str, reference: str) -> float:
    """1.0 when the integer after the last ``answer:`` in ``response`` equals ``reference``."""
    matches = _ANSWER.findall(response)
    return 1.0 if matches and int(matches[-1]) == int(reference) else 0.0
