"""Math answer reward: extract the model's final answer, compare it to the reference with math-verify.

A wrong verifier silently trains the wrong thing, so equivalence is never hand-written here:
``math-verify`` (sympy-backed) decides whether ``\\frac{1}{2}`` equals ``0.5`` or ``1,000`` equals
``1000``. This module only decides *which part* of a response is the final answer:

1. the configurable patterns (LightEval style, e.g. ``(?i)final answer is:?\\s*(.+)``), last match;
2. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
3. the GSM8K marker ``#### N``, last occurrence that is not a markdown heading (``#### Step 1``,
   ``#### Final Answer``: text starting with a word);
4. otherwise math-verify's own extraction over the whole response (LaTeX, then plain expressions).

References are used as stored in the benchmark files: a GSM8K solution is cut at its ``####``.
Dataset loading checks every reference (``reference_problem``: the file, row and field are
named); one that still cannot be parsed at run time scores 0.0, is logged and is counted
(``reward_errors`` in the trainer's metrics), never a crash of the rollout worker.

Hostile responses: every extraction step is linear in the response length (a regex scan for the
GSM8K marker takes 125 s on one crafted 130 kB answer; ``gsm8k_answers`` is one pass).

Timeouts: math-verify interrupts parsing and comparison with ``signal.alarm``, which only works
in a main thread. In the main thread the check runs inline with those timeouts; from any other
thread (the rollout worker scores in a thread pool) it runs in a helper process with a hard
timeout on top (``math_pool``, ``math_worker``). ``MathRewardConfig.isolation`` can force either way.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import asdict

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from megatron_darl import counters
from megatron_darl.rewards.config import MathRewardConfig  # noqa: F401 (re-exported: its old home)
from megatron_darl.rewards.math_pool import verify_in_helper

logger = logging.getLogger(__name__)

_HEADING = re.compile(r"[A-Za-z]{2,}(?:\s|:|$)")  # "#### Final Answer" is markdown, not an answer
_BOXED_OPENERS = ("\\boxed{", "\\fbox{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text`` (nested braces balanced)."""
    start = max(text.rfind(opener) for opener in _BOXED_OPENERS)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: the response was cut off inside the box


def _pattern_answer(text: str, patterns: list[str]) -> str | None:
    for pattern in patterns:
        matches = list(re.finditer(pattern, text))
        if matches:
            last = matches[-1]
            return (last.group(1) if last.groups() else last.group(0)).strip()
    return None


def extract_answer(response: str, cfg: MathRewardConfig | None = None) -> str | None:
    """The final-answer substring of ``response``, or None when no explicit answer is marked.

    None means "let math-verify search the whole response" (when configured).
    """
    cfg = cfg or MathRewardConfig()
    answer = _pattern_answer(response, cfg.answer_patterns)
    if answer is None and cfg.boxed:
        answer = last_boxed(response)
    if answer is None and cfg.gsm8k_marker:
        matches = [m for m in gsm8k_answers(response) if not _HEADING.match(m)]
        answer = matches[-1] if matches else None
    if answer is not None:
        answer = " ".join(answer.split())  # whitespace runs mean nothing in an answer; parsers choke on them
        answer = answer.rstrip(".").strip()
        answer = answer[1:-1].strip() if len(answer) > 1 and answer[0] == answer[-1] == "$" else answer
    return answer


def gsm8k_answers(text: str) -> list[str]:
    """Text after each ``####`` marker to the end of its line (right-stripped), in one pass.

    The same captures as ``re.findall(r"####\s*(.+?)\s*$", text, re.MULTILINE)`` (the whitespace
    after a marker may span lines; a marker followed only by whitespace gives ""), without that
    pattern's quadratic backtracking on long runs of spaces.
    """
    out: list[str] = []
    pos, n = 0, len(text)
    while (start := text.find("####", pos)) >= 0:
        q = start + 4
        while q < n and text[q].isspace():
            q += 1
        if q == n:  # only whitespace after the marker
            if any(c != "\n" for c in text[start + 4:]):
                out.append("")
            break
        end = text.find("\n", q)
        end = n if end < 0 else end
        out.append(text[q:end].rstrip())
        pos = end
    return out


_PLAIN_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # fullmatch: GSM8K-style answers, no parse needed


def reference_problem(reference: str) -> str | None:
    """Why ``reference`` cannot serve as a math reference, or None when it can (load-time check)."""
    answer = reference_answer(reference)
    if not answer:
        return "has no answer (empty, or nothing after '####')"
    if _PLAIN_NUMBER.fullmatch(answer):
        return None
    if not _parse_reference(reference, _timeout(_DEFAULT_CONFIG)):
        return f"answer {answer[:80]!r} cannot be parsed by math-verify"
    return None


def reference_answer(reference: str) -> str:
    """The answer part of a stored reference (a GSM8K solution keeps only what follows ``####``)."""
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    return reference.strip()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _timeout(cfg: MathRewardConfig) -> int | None:
    if _in_main_thread() and cfg.timeout_seconds > 0:
        return cfg.timeout_seconds
    return None  # signal.alarm is main-thread only (see module docstring)


_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def _parse_answer(answer: str, timeout: int | None) -> list:
    return parse(f"$\\boxed{{{answer}}}$", _EXTRACTION, parsing_timeout=timeout)


_REFERENCE_CACHE: dict[str, list] = {}  # reference text -> parsed gold (successes only)
_REFERENCE_CACHE_SIZE = 8192


def _parse_reference(reference: str, timeout: int | None) -> list:
    """Parsed gold answer, cached; a failed parse is retried once with 4x the timeout (it may
    have been a slow machine, not a bad reference) and never cached."""
    gold = _REFERENCE_CACHE.get(reference)
    if gold is None:
        answer = reference_answer(reference)
        gold = _parse_answer(answer, timeout)
        if not gold and timeout is not None:
            gold = _parse_answer(answer, 4 * timeout)
        if gold and len(_REFERENCE_CACHE) < _REFERENCE_CACHE_SIZE:
            _REFERENCE_CACHE[reference] = gold
    return gold


def math_reward_with(response: str, reference: str, cfg: MathRewardConfig) -> float:
    """``math_reward`` with an explicit extraction config (see the module docstring on timeouts).

    A reference that cannot be parsed scores 0.0 and is logged and counted (``reward_errors``).
    """
    try:
        if cfg.isolation == "process" or (cfg.isolation == "auto" and not _in_main_thread()):
            request = {"response": response, "reference": reference, "cfg": asdict(cfg)}
            return verify_in_helper(request, cfg.hard_timeout_seconds, cfg.pool_workers)
        return verify_inline(response, reference, cfg)
    except ValueError as exc:
        total = counters.count(counters.REWARD_ERRORS)
        logger.error("reward error %d (scored 0.0): %s", total, exc)
        return 0.0


def verify_inline(response: str, reference: str, cfg: MathRewardConfig) -> float:
    """The check itself, in this thread (timeouts only when it is a main thread)."""
    timeout = _timeout(cfg)
    gold = _parse_reference(reference, timeout)
    if not gold:
        raise ValueError(f"math reference {reference!r} cannot be parsed by math-verify")
    answer = extract_answer(response, cfg)
    if answer is not None:
        pred = _parse_answer(answer, timeout)
    elif cfg.fallback_to_math_verify:
        pred = parse(response, _EXTRACTION, parsing_timeout=timeout)
    else:
        return 0.0
    if not pred:
        return 0.0
    try:
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception as exc:  # math-verify raises on pathological sympy input; that is a miss
        logger.debug("math-verify failed on %r vs %r: %s", answer, reference, exc)
        return 0.0


def math_reward(response: str, reference: str) -> float:
    """1.0 when the final answer in ``response`` equals ``reference`` (as stored in its file), else 0.0.

    Args:
        response: model output; the answer is the last ``#### N`` or ``\\boxed{...}`` or, failing
            those, whatever math-verify extracts from the text.
        reference: the benchmark's reference answer (a GSM8K solution with ``####`` is accepted).
    """
    return math_reward_with(response, reference, _DEFAULT_CONFIG)


_DEFAULT_CONFIG = MathRewardConfig()
