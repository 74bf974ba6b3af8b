"""The countdown task: seeded solvable problems, a disjoint held-out split, format-only warm-start
targets, and a verifier that gives 1 to correct chains and 0 to anything else."""

import random

import pytest

from megatron_darl.data import load_data_config, load_dataset
from megatron_darl.data.config import DataConfig
from megatron_darl.data.countdown import (
    CountdownProblem, countdown_records, format_example, parse_prompt, split_of,
)
from megatron_darl.data.config import CountdownTaskConfig
from megatron_darl.data.records import PromptRecord
from megatron_darl.rewards import check_chain, countdown_reward, get_reward_fn, score
from megatron_darl.rewards.countdown import record_reward

PRESET = "configs/data/countdown.yaml"


def _cfg(**kw) -> CountdownTaskConfig:
    return CountdownTaskConfig(**{"num_prompts": 300, **kw})


def test_generation_is_deterministic_with_the_seed():
    a, b = countdown_records(_cfg(seed=3)), countdown_records(_cfg(seed=3))
    assert [(r.prompt, r.metadata["solution"]) for r in a] == [(r.prompt, r.metadata["solution"]) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in countdown_records(_cfg(seed=4))]
    assert [r.prompt_id for r in a] == list(range(300))
    assert {len(r.metadata["numbers"]) for r in a} == {3, 4}


@pytest.mark.parametrize("order,ops", [("any", "+-*"), ("left", "+-"), ("left", "+-*")])
def test_every_problem_is_solved_by_its_reference_chain(order, ops):
    fn = get_reward_fn("countdown")
    records = countdown_records(_cfg(order=order, operators=ops, min_numbers=3, max_numbers=6))
    for r in records:
        assert 1 <= int(r.reference) <= 100
        assert all(1 <= n <= 9 for n in r.metadata["numbers"])
        assert fn(r, r.metadata["solution"]) == 1.0, (r.prompt, r.metadata["solution"])
        assert score(r, r.metadata["solution"]) == 1.0
    assert len({r.prompt for r in records}) > 250


def test_train_and_test_splits_are_disjoint_and_hash_defined():
    train = countdown_records(_cfg(num_prompts=2000, split="train", min_numbers=3, max_numbers=3))
    test = countdown_records(_cfg(num_prompts=300, split="test", seed=9, min_numbers=3, max_numbers=3))
    key = lambda r: (tuple(sorted(r.metadata["numbers"])), r.reference)  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert all(r.metadata["split"] == "test" for r in test)
    # the split is a property of the problem (numbers in any order and target), not of the seed
    p = CountdownProblem((3, 7, 5), 26)
    assert split_of(p, 0.1) == split_of(CountdownProblem((5, 3, 7), 26), 0.1)
    shares = [split_of(CountdownProblem((a, b, c), t), 0.1) == "test"
              for a in range(1, 10) for b in range(a, 10) for c in range(b, 10) for t in range(1, 30)]
    assert 0.07 < sum(shares) / len(shares) < 0.13


def test_preset_loads_through_the_data_loader():
    data = load_data_config(PRESET)
    assert data.task == "countdown" and data.countdown.order == "left"
    head = load_dataset(load_data_config(PRESET, {"countdown": {"num_prompts": 50}})).records
    assert len(head) == 50 and all(r.task == "countdown" for r in head)
    assert {len(r.metadata["numbers"]) for r in head} <= {4, 5, 6}


def test_format_targets_are_valid_chains_that_ignore_the_target():
    """The warm start's targets pass every check but the last one, except by chance."""
    rng = random.Random(0)
    records = countdown_records(_cfg(num_prompts=1000, order="left", operators="+-",
                                     min_numbers=4, max_numbers=6))
    reasons = [check_chain(format_example(r, rng, "+-", "left"), r.metadata["numbers"], int(r.reference))
               for r in records]
    assert all(why == "" or why.startswith("reaches") for why in reasons)
    chance = reasons.count("") / len(reasons)
    assert 0.05 < chance < 0.2  # the chance rate the RL phase starts from


def test_verifier_scores_correct_chains_one_and_wrong_ones_zero():
    nums, target = [3, 7, 5], 26
    assert countdown_reward("7*3=21\n21+5=26", nums, target) == 1.0
    assert countdown_reward("  3 * 7 = 21 \n\n 21 + 5 = 26\n", nums, target) == 1.0  # spaces, blank lines
    assert countdown_reward("5+7=12\n12*3=36", nums, 36) == 1.0  # any order of the numbers
    assert countdown_reward("3-7=-4\n-4+5=1", nums, 1) == 1.0  # negative intermediate results
    wrong = {
        "7*3=21\n21+5=27": "wrong arithmetic",
        "7*3=21\n21+5=26\n": "",
        "7*3=21": "left unused",
        "7*3=21\n21+6=27": "not available",
        "7*7=49\n49-23=26": "not available",  # 7 used twice
        "7*3=21\n21+5=26\n26-0=26": "not available",  # a number that was never given
        "7*3=21\n21-5=16": "not the target",
        "answer: 26": "not 'a op b=c'",
        "7/3=2\n2+5=7": "not 'a op b=c'",
        "": "empty",
    }
    for response, why in wrong.items():
        assert (countdown_reward(response, nums, target) == 1.0) == (why == ""), response
        assert why in check_chain(response, nums, target)


def test_partial_credit_goes_to_valid_chains_that_miss_only():
    nums, target = [3, 7, 5], 26
    assert countdown_reward("7*3=21\n21+5=26", nums, target, 0.1) == 1.0
    assert countdown_reward("7*3=21\n21-5=16", nums, target, 0.1) == 0.1  # valid, misses
    assert countdown_reward("7*3=21\n21+5=27", nums, target, 0.1) == 0.0  # wrong arithmetic
    assert countdown_reward("7*3=21", nums, target, 0.1) == 0.0  # a number left unused
    record = countdown_records(_cfg(num_prompts=1, valid_chain_reward=0.2))[0]
    rng = random.Random(1)
    chains = {format_example(record, rng) for _ in range(50)}
    assert sorted({record_reward(record, c) for c in chains}) == [0.2, 1.0]  # misses and hits
    assert record_reward(record, "garbage") == 0.0
    with pytest.raises(ValueError, match="valid_chain_reward"):
        CountdownTaskConfig(valid_chain_reward=1.0)


@pytest.mark.parametrize("garbage", ["\x00\x01", "1" * 5000, "-" * 100, "7*3=21=21", "9" * 30 + "+1=1",
                                     "__import__('os').system('true')", "7 * 3 = 21\n21 + 5 = 2 6"])
def test_verifier_never_raises_on_malformed_responses(garbage):
    assert countdown_reward(garbage, [3, 7, 5], 26) == 0.0


@pytest.mark.parametrize("hostile", [
    "1" + " " * 50_000 + "+",  # whitespace runs around the operator (regex backtracking)
    " " * 50_000 + "1 " + " " * 50_000,
    "3 + 7 = 10\n" * 200_000,  # a response far past any max_new_tokens
    "3 + 3 = 6\n6 + 7 = 13\n13 * 2 = 26",  # reaches the target by using 3 twice
    "3 + 7 = 10\n10 + 5 = 15\n15 + 11 = 26",  # a number that was never given
])
def test_hostile_responses_score_zero_quickly(hostile):
    """Responses built to slow the checker or to reach the target by cheating score 0 within a
    second (the checker is linear in the response and never evaluates it)."""
    import time

    start = time.monotonic()
    assert countdown_reward(hostile, [3, 7, 5], 26) == 0.0
    assert time.monotonic() - start < 1.0


def test_malformed_records_and_configs_raise_naming_the_field():
    bad = PromptRecord(prompt_id=7, prompt="3 7 -> 10", messages=[], task="countdown", reference="ten",
                       metadata={"numbers": [3, 7]})
    with pytest.raises(ValueError, match="countdown record 7"):
        record_reward(bad, "3+7=10")
    with pytest.raises(ValueError, match="countdown record 8"):
        record_reward(PromptRecord(8, "x", [], "countdown", "10", metadata={}), "3+7=10")
    with pytest.raises(ValueError, match="min_numbers"):
        CountdownTaskConfig(min_numbers=1)
    with pytest.raises(ValueError, match="operators"):
        CountdownTaskConfig(operators="+/")
    with pytest.raises(ValueError, match="split"):
        CountdownTaskConfig(split="dev")
    with pytest.raises(ValueError, match="order"):
        CountdownTaskConfig(order="right")
    with pytest.raises(ValueError, match="data.task='math' with source 'builtin'"):
        DataConfig(task="math", source="builtin")
    with pytest.raises(ValueError, match="not a countdown prompt"):
        parse_prompt("3+7=")
    assert parse_prompt("3 7 5 -> 26") == CountdownProblem((3, 7, 5), 26)


def test_launcher_refuses_countdown_without_a_task_policy(tmp_path):
    """The embedded warm start knows the arithmetic format only: data=countdown needs model.path."""
    from launch.config import load_run_config
    from launch.preflight import check_task

    with pytest.raises(ValueError, match="data.task='countdown' needs model.path.*task_warmstart"):
        check_task(load_run_config(["data=countdown"]))
    check_task(load_run_config(["data=countdown", f"model.path={tmp_path}"]))
    check_task(load_run_config([]))  # the arithmetic default keeps its own warm start
