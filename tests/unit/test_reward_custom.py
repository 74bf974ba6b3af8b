"""A user's own reward (``reward.fn``): resolved from a real module or file written here, called
with verl's ``compute_score`` keywords, and every failure of it (a raise, a value that is not a
finite number, a slow or hung sync or async call) scored 0.0 and counted, never raised."""

from __future__ import annotations

import logging
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from megatron_darl import counters
from megatron_darl.data.records import PromptRecord
from megatron_darl.rewards.config import MathRewardConfig, RewardConfig
from megatron_darl.rewards.custom import CustomReward, as_reward, check_reward
from megatron_darl.rewards.registry import get_reward_fn

USER_MODULE = '''
import asyncio, json, math, threading, time

CALLS = []
RELEASE = threading.Event()

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    CALLS.append(dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                      extra_info=extra_info, bonus=bonus))
    return float(ground_truth in solution_str) + bonus

def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": True}

def by_answer(data_source, solution_str, ground_truth, extra_info=None):
    kind = solution_str
    if kind == "raise":
        raise KeyError("no such field")
    if kind == "nan":
        return math.nan
    if kind == "text":
        return "1.0"
    if kind == "none":
        return None
    if kind == "numpy":
        import numpy
        return numpy.float32(0.75)
    if kind == "tensor":
        import torch
        return torch.tensor(0.25)
    if kind == "bool":
        return True
    return 1.0

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(30)
    return 1.0

def quits(data_source, solution_str, ground_truth, extra_info=None):
    raise SystemExit(3)

def hung(data_source, solution_str, ground_truth, extra_info=None):
    RELEASE.wait(60)
    return 1.0

async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0.01)
    return 0.5 if solution_str == "quick" else await asyncio.sleep(30)

NOT_A_FUNCTION = 3

def two_args(response, reference):
    return 1.0
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_reward_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _record(prompt_id=7, reference="42", **metadata) -> PromptRecord:
    return PromptRecord(prompt_id, "What is 6 x 7?", [{"role": "user", "content": "What is 6 x 7?"}], "gsm8k",
                        reference, metadata={"source_id": f"row-{prompt_id}", **metadata}, source="data.jsonl:8")


def test_a_verl_compute_score_gets_the_record_by_verl_s_keywords(user_module, tmp_path):
    reward = get_reward_fn("gsm8k", RewardConfig(fn=f"{user_module}:compute_score", fn_kwargs={"bonus": 0.5}))
    assert reward(_record(), "so it is 42") == 1.5 and reward(_record(), "it is 41") == 0.5
    call = __import__(user_module).CALLS[0]
    assert call["data_source"] == "gsm8k" and call["solution_str"] == "so it is 42" and call["ground_truth"] == "42"
    assert call["bonus"] == 0.5
    info = call["extra_info"]
    assert info["index"] == 7 and info["source_id"] == "row-7" and info["prompt"] == "What is 6 x 7?"
    assert info["task"] == "gsm8k" and info["source"] == "data.jsonl:8" and info["messages"][0]["role"] == "user"
    # a dataset that keeps verl's data_source column hands it on; the file form loads the same function
    by_file = get_reward_fn("math", RewardConfig(fn=f"{tmp_path / user_module}.py:compute_score"))
    assert by_file(_record(data_source="openai/gsm8k"), "42") == 1.0
    assert by_file.fn.__module__.startswith("darl_reward_")
    assert sys.modules[by_file.fn.__module__].CALLS[-1]["data_source"] == "openai/gsm8k"


def test_return_values_verl_and_numeric_kinds():
    assert as_reward({"score": 0.5, "acc": True}) == 0.5
    assert as_reward(np.float32(0.75)) == 0.75 and as_reward(torch.tensor(0.25)) == 0.25
    assert as_reward(True) == 1.0 and as_reward(3) == 3.0
    for bad, why in ((float("nan"), "not a finite number"), (float("inf"), "not a finite number"),
                     ("1.0", "str '1.0', not a number"), (None, "NoneType None, not a number"),
                     ({"acc": 1}, "without 'score'"), (torch.ones(2), "Tensor")):
        with pytest.raises((TypeError, ValueError), match=why):
            as_reward(bad)


def test_failures_score_zero_are_counted_and_logged_with_the_record_id(user_module, caplog):
    reward = get_reward_fn("gsm8k", RewardConfig(fn=f"{user_module}:by_answer"))
    good = {"numpy": 0.75, "tensor": 0.25, "bool": 1.0, "fine": 1.0}
    assert {k: reward(_record(), k) for k in good} == good
    before = counters.snapshot().get(counters.REWARD_ERRORS, 0)
    with caplog.at_level(logging.ERROR, logger="megatron_darl.rewards.custom"):
        kinds = ["raise", "nan", "text", "none", "raise"]
        scores = [reward(_record(prompt_id=i), kind) for i, kind in enumerate(kinds)]
    quits = get_reward_fn("gsm8k", RewardConfig(fn=f"{user_module}:quits"))
    assert scores == [0.0] * 5 and quits(_record(), "x") == 0.0  # even sys.exit() in it ends no worker
    assert counters.snapshot()[counters.REWARD_ERRORS] - before == 6
    logged = [r for r in caplog.records if r.name == "megatron_darl.rewards.custom" and ":by_answer " in r.getMessage()]
    assert len(logged) == 3  # the 1st (with its traceback), 2nd and 4th failure
    assert "prompt 0 (id row-0) at data.jsonl:8" in logged[0].getMessage() and "KeyError" in logged[0].getMessage()
    assert logged[0].exc_info is not None and logged[1].exc_info is None
    assert "prompt 1 " in logged[1].getMessage() and "not a finite number" in logged[1].getMessage()
    assert "prompt 3 " in logged[2].getMessage() and "NoneType" in logged[2].getMessage()


def test_slow_hung_and_async_calls_end_at_their_deadline(user_module):
    module = __import__(user_module)
    before = counters.snapshot().get(counters.REWARD_TIMEOUTS, 0)
    slow = CustomReward(module.slow, "m:slow", timeout_s=0.3, max_inflight=4)
    start = time.monotonic()
    assert slow(_record(), "x") == 0.0
    assert time.monotonic() - start < 3.0
    hasty = get_reward_fn("gsm8k", RewardConfig(fn=f"{user_module}:async_score", fn_timeout_s=0.3))
    assert hasty(_record(), "quick") == 0.5  # awaited in an event loop of its own
    start = time.monotonic()
    assert hasty(_record(), "slow") == 0.0
    assert time.monotonic() - start < 3.0
    # a call that never returns keeps its slot: the next one waits at most its deadline, then scores 0
    one_slot = CustomReward(module.hung, "m:hung", timeout_s=0.2, max_inflight=1)
    results = []
    threads = [threading.Thread(target=lambda: results.append(one_slot(_record(), "x"))) for _ in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results == [0.0, 0.0] and time.monotonic() - start < 3.0
    assert counters.snapshot()[counters.REWARD_TIMEOUTS] - before == 4
    module.RELEASE.set()  # the hung call returns: its slot is free again
    deadline = time.monotonic() + 5
    while not one_slot._slots.acquire(timeout=0.1):
        assert time.monotonic() < deadline
    one_slot._slots.release()
    assert one_slot(_record(), "x") == 1.0


def test_names_that_cannot_serve_are_refused_in_one_line_naming_reward_fn(user_module, tmp_path):
    cases = {
        "no_such_package.rewards:compute_score": "no module named 'no_such_package'",
        f"{user_module}:nope": "has no attribute 'nope'",
        f"{user_module}:NOT_A_FUNCTION": "NOT_A_FUNCTION is a int, not a function",
        f"{user_module}:two_args": "cannot be called as fn(data_source=",
        f"{tmp_path}/missing.py:f": "no such file",
    }
    (tmp_path / "broken_reward.py").write_text("import no_such_dependency\n")
    cases["broken_reward:f"] = "importing broken_reward failed: No module named 'no_such_dependency'"
    for spec, why in cases.items():
        cfg = type("Run", (), {"reward": RewardConfig(fn=spec)})()
        with pytest.raises(ValueError) as err:
            check_reward(cfg)
        message = str(err.value)
        assert message.startswith(f"reward.fn={spec}") and why in message and "\n" not in message, message
    with pytest.raises(ValueError, match=r"^reward.fn='compute_score': use package.module:function"):
        RewardConfig(fn="compute_score")
    with pytest.raises(ValueError, match=r"reward.fn_timeout_s=0"):
        RewardConfig(fn_timeout_s=0)
    with pytest.raises(ValueError, match=r"reward.math.answer_patterns\[1\]='\(' is not a regex"):
        MathRewardConfig(answer_patterns=["answer: (.+)", "("])


def test_on_resume_reward_timeouts_may_change_what_is_rewarded_may_not(tmp_path):
    from omegaconf import OmegaConf

    from launch.config import load_run_config, save_run_config
    from launch.resume_changes import check_resume

    base = ["experiment=smoke", "loop.run_dir=runs/x"]
    old = OmegaConf.to_container(OmegaConf.load(save_run_config(load_run_config(base), tmp_path / "run_config.yaml")))
    # the sandbox's tuple of paths comes back from YAML as a list: not a change
    assert check_resume(old, load_run_config(base), "old.yaml") == []
    allowed = check_resume(old, load_run_config(base + ["reward.fn_timeout_s=5", "reward.math.timeout_seconds=9"]),
                           "old.yaml")
    assert sorted(str(c) for c in allowed) == ["reward.fn_timeout_s: 60.0 -> 5.0",
                                               "reward.math.timeout_seconds: 5 -> 9"]
    for override, key in (("reward.fn=m:f", "reward.fn"), ("reward.math.boxed=false", "reward.math.boxed"),
                          ("reward.code.stdio_scoring=fraction", "reward.code.stdio_scoring")):
        with pytest.raises(ValueError, match=rf"^loop.resume=true: {key} changed from .* refused, the buffered "
                                             "samples were scored with it"):
            check_resume(old, load_run_config(base + [override]), "old.yaml")


def test_a_custom_reward_s_references_are_not_held_to_the_task_s_math_check():
    from megatron_darl.rewards.references import reference_check

    assert "has no answer" in reference_check("math")("see the rubric ####")  # nothing math-verify can grade
    assert reference_check("math", RewardConfig(fn="my_rewards:judge")) is None
