"""Math rewards: every GSM8K, MATH-500 and AIME24 reference scores 1.0 against itself written in
other forms (boxed, GSM8K marker, plain prose, decimals for fractions, thousands separators)
and 0.0 against a changed answer. Runs over the shared benchmark files; skips without them."""

import json
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from megatron_darl.rewards import MathRewardConfig, extract_answer, math_reward
from megatron_darl.rewards.math_answer import last_boxed, math_reward_with, reference_answer

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("DARL_BENCHMARK_DIR", REPO.parent / "shared" / "data" / "benchmarks"))


def _references(relpath: str) -> list[str]:
    path = BENCH / relpath
    if not path.is_file():
        pytest.skip(f"benchmark file {path} not present (set DARL_BENCHMARK_DIR)")
    return [json.loads(line)["answer"] for line in path.read_text().splitlines() if line.strip()]


def equivalent_forms(answer: str) -> list[str]:
    """The same answer as a model might write it."""
    forms = [
        f"Let me work it out step by step.\nSo the answer is \\boxed{{{answer}}}.",
        f"Adding things up gives the result.\n#### {answer}",
        f"After simplifying, the final answer is ${answer}$.",
    ]
    frac = re.fullmatch(r"\\d?frac\{(\d+)\}\{(\d+)\}", answer)
    if frac:
        num, den = int(frac[1]), int(frac[2])
        rest = den
        for p in (2, 5):
            while rest % p == 0:
                rest //= p
        if rest == 1:  # terminating decimal
            forms.append(f"The answer is \\boxed{{{num / den}}}")
    digits = answer.replace(",", "")
    if re.fullmatch(r"\d{4,}", digits):
        forms.append(f"The total is \\boxed{{{int(digits):,}}} dollars.")
        forms.append(f"The total is {int(digits):,} dollars.")
        forms.append(f"#### {digits}")
    return forms


def changed(answer: str) -> str:
    """A different answer: the first integer in it incremented (or a term added)."""
    m = re.search(r"\d+", answer)
    if m:
        return answer[: m.start()] + str(int(m.group()) + 1) + answer[m.end():]
    return answer + "+7"


# math_reward's logic with a generous timeout: this checks equivalence, and a loaded CI machine
# must not turn a slow parse into a false failure.
PATIENT = MathRewardConfig(timeout_seconds=60)


def _failures(reference: str) -> list[str]:
    answer = reference_answer(reference)
    bad = [form for form in equivalent_forms(answer) if math_reward_with(form, reference, PATIENT) != 1.0]
    wrong = changed(answer)
    if math_reward_with(f"So the answer is \\boxed{{{wrong}}}.", reference, PATIENT) != 0.0:
        bad.append(f"changed answer {wrong!r} accepted")
    return bad


@pytest.mark.parametrize("relpath", ["gsm8k/test.jsonl", "math500/test.jsonl", "aime24/test.jsonl"])
def test_every_reference_matches_its_forms_and_rejects_changes(relpath):
    refs = _references(relpath)
    with ProcessPoolExecutor(2) as pool:  # math-verify uses signal.alarm: processes, not threads
        results = list(pool.map(_failures, refs, chunksize=32))
    failures = {ref[-60:]: bad for ref, bad in zip(refs, results) if bad}
    assert not failures, f"{len(failures)} of {len(refs)} references failed: {list(failures.items())[:5]}"


def test_gsm8k_reference_is_cut_at_marker():
    assert reference_answer("She has 3 + 4 = 7 apples.\n#### 7") == "7"
    assert math_reward("\\boxed{7}", "She has 3 + 4 = 7 apples.\n#### 7") == 1.0
    assert math_reward("\\boxed{3}", "She has 3 + 4 = 7 apples.\n#### 7") == 0.0


def test_last_boxed_balances_nested_braces_and_takes_the_last():
    text = "first \\boxed{1} then \\boxed{\\frac{1}{2}} and \\fbox{x^{2}}"
    assert last_boxed(text) == "x^{2}"
    assert last_boxed("\\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("cut off \\boxed{\\frac{1}{") is None
    assert last_boxed("no box") is None


def test_extraction_order_patterns_then_boxed_then_marker():
    cfg = MathRewardConfig(answer_patterns=[r"(?i)final answer:\s*(\S+)"])
    text = "\\boxed{3}\n#### 4\nFinal answer: 5"
    assert extract_answer(text, cfg) == "5"
    assert extract_answer(text) == "3"
    assert extract_answer("so 3 + 1 = 4\n#### 4") == "4"
    assert extract_answer("nothing marked here") is None


def test_markdown_heading_is_not_a_gsm8k_marker():
    response = "#### Step 1\nAdd them.\n#### Final Answer\n$\\boxed{42}$"
    assert extract_answer(response) == "42"
    assert math_reward(response, "42") == 1.0
    assert extract_answer("#### Step 1: add\nThe answer is 42.") is None  # heading skipped
    assert math_reward("#### Final Answer\nThe answer is 42.", "42") == 1.0  # math-verify finds it


def test_configurable_pattern_changes_the_verdict():
    response = "I think \\boxed{12}. Answer: 13"
    assert math_reward(response, "13") == 0.0
    cfg = MathRewardConfig(answer_patterns=[r"Answer:\s*(-?\d+)"])
    assert math_reward_with(response, "13", cfg) == 1.0


def test_no_fallback_means_unmarked_answers_score_zero():
    assert math_reward("the result is $42$", "42") == 1.0
    cfg = MathRewardConfig(fallback_to_math_verify=False)
    assert math_reward_with("the result is $42$", "42", cfg) == 0.0


def test_garbage_and_empty_responses_score_zero():
    assert math_reward("", "42") == 0.0
    assert math_reward("\\boxed{}", "42") == 0.0
    assert math_reward("\\boxed{\\frac{", "\\frac{1}{2}") == 0.0


def test_unparseable_reference_scores_zero_and_is_counted():
    from megatron_darl import counters

    before = counters.snapshot().get(counters.REWARD_ERRORS, 0)
    assert math_reward("\\boxed{1}", "") == 0.0  # a logged, counted error, not a crash
    assert counters.snapshot()[counters.REWARD_ERRORS] == before + 1


def test_gsm8k_scan_matches_the_old_regex_on_random_text():
    import random
    import re

    from megatron_darl.rewards.math_answer import gsm8k_answers

    old = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(["#", "#", " ", "\n", "\t", "a", "5", "\r", "\u00a0"])
                       for _ in range(rng.randrange(30)))
        assert [m.strip() for m in gsm8k_answers(text)] == [m.strip() for m in old.findall(text)], repr(text)


def test_off_main_thread_checks_run_in_helpers_with_the_same_verdicts():
    from concurrent.futures import ThreadPoolExecutor

    responses = ["\\boxed{0.5}", "#### 0.5", "\\boxed{3}", "so it is $\\frac{2}{4}$"]
    inline = [math_reward(r, "\\frac{1}{2}") for r in responses]
    with ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(lambda r: math_reward(r, "\\frac{1}{2}"), responses))
    assert threaded == inline == [1.0, 1.0, 0.0, 1.0]


def test_a_check_waiting_for_a_helper_gets_one_when_the_busy_helpers_time_out():
    """With every helper busy, a check waits; when the busy ones are killed at their timeout (no
    helper goes back idle), the room they leave must start a helper for it, not leave it waiting
    for an idle one that will never come (a rollout worker's reward thread hung so)."""
    import threading

    from megatron_darl.rewards import math_pool

    math_pool.shutdown()
    slow = "\\boxed{" + "+".join(f"x_{i}" for i in range(3000)) + "}"
    hasty = MathRewardConfig(isolation="process", hard_timeout_seconds=0.3, pool_workers=1)
    got: dict[str, float] = {}
    stuck = threading.Thread(target=lambda: got.setdefault("slow", math_reward_with(slow, "7", hasty)))
    stuck.start()
    deadline = time.monotonic() + 10
    while not math_pool._live and time.monotonic() < deadline:  # the one helper is taken
        time.sleep(0.01)
    patient = MathRewardConfig(isolation="process", pool_workers=1)  # a new helper's start fits its timeout
    waiting = threading.Thread(target=lambda: got.setdefault("next", math_reward_with("\\boxed{7}", "7", patient)),
                               daemon=True)
    waiting.start()
    stuck.join(30)
    waiting.join(30)
    assert not waiting.is_alive(), "the waiting check never got a helper"
    assert got == {"slow": 0.0, "next": 1.0}
    math_pool.shutdown()


def test_helper_past_its_hard_timeout_scores_zero_and_is_replaced():
    from megatron_darl.rewards import math_pool

    patient = MathRewardConfig(isolation="process")
    assert math_reward_with("\\boxed{7}", "7", patient) == 1.0  # helper started and warm
    before = set(math_pool._live)
    hasty = MathRewardConfig(isolation="process", hard_timeout_seconds=0.01)
    slow = "\\boxed{" + "+".join(f"x_{i}" for i in range(3000)) + "}"  # takes the helper well over 10 ms
    assert math_reward_with(slow, "7", hasty) == 0.0
    assert len(before - math_pool._live) == 1  # the silent helper was killed
    assert math_reward_with("\\boxed{7}", "7", patient) == 1.0  # and a fresh one answers
    assert math_reward_with("\\boxed{1}", "", patient) == 0.0  # unparseable reference: counted, not raised
    with pytest.raises(ValueError, match="isolation"):
        MathRewardConfig(isolation="thread")
    math_pool.shutdown()
    assert not math_pool._live
