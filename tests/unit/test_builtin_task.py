"""The built-in arithmetic task: seeded prompts, correct reference solutions, exact-match
reward, a short-prompt character tokenizer that round-trips through AutoTokenizer."""

import pytest
from transformers import AutoTokenizer

from megatron_darl.data import (
    BuiltinTaskConfig,
    build_builtin_tokenizer,
    builtin_prompts,
    builtin_records,
    encode_prompt,
    load_data_config,
    load_dataset,
    reference_solution,
)
from megatron_darl.data.builtin import SPECIAL_TOKENS, parse_problem
from megatron_darl.rewards import get_reward_fn, score
from megatron_darl.rewards.builtin_answer import builtin_reward


def test_prompts_are_seeded_and_varied():
    a, b = builtin_prompts(200, seed=3), builtin_prompts(200, seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in builtin_prompts(200, seed=4)]
    assert len({r.prompt for r in a}) > 150
    assert {len(r.metadata["operands"]) for r in a} == {2, 3}
    assert all(r.task == "builtin" and r.prompt.endswith("=") for r in a)
    assert [r.prompt_id for r in a] == list(range(200))


def test_references_evaluate_left_to_right():
    for r in builtin_prompts(300, seed=0, max_value=50, operators="+-*"):
        expr = r.prompt[:-1]
        ops = r.metadata["operators"]
        values = r.metadata["operands"]
        acc = values[0]
        for op, v in zip(ops, values[1:]):
            acc = acc + v if op == "+" else acc - v if op == "-" else acc * v
        assert int(r.reference) == acc, expr
    assert parse_problem("12+7-5=").answer == 14


def test_reference_solution_shows_steps_and_ends_with_answer():
    assert reference_solution("12+7-5=") == "12+7=19\n19-5=14\nanswer: 14"
    assert reference_solution("3-9=", show_steps=False) == "answer: -6"
    for r in builtin_prompts(100, seed=1):
        assert builtin_reward(reference_solution(r), r.reference) == 1.0
    with pytest.raises(ValueError, match="not a built-in"):
        reference_solution("what is 2+2?")


def test_exact_match_reward():
    assert builtin_reward("answer: 14", "14") == 1.0
    assert builtin_reward("12+7=19\nanswer: -3", "-3") == 1.0
    assert builtin_reward("answer: 13", "14") == 0.0
    assert builtin_reward("answer: 140", "14") == 0.0
    assert builtin_reward("answer: 13\nanswer: 14", "14") == 1.0  # the last answer counts
    assert builtin_reward("14", "14") == 0.0  # no answer line
    assert builtin_reward("", "14") == 0.0


def test_registry_scores_builtin_records():
    record = builtin_prompts(1, seed=5)[0]
    assert get_reward_fn("builtin")(record, reference_solution(record)) == 1.0
    assert score(record, "answer: 99999") == 0.0


def test_difficulty_is_validated():
    with pytest.raises(ValueError, match="min_operands"):
        builtin_prompts(1, min_operands=1)
    with pytest.raises(ValueError, match="operators"):
        builtin_prompts(1, operators="/")
    with pytest.raises(ValueError, match="max_value"):
        builtin_prompts(1, max_value=0)


def test_preset_generates_the_configured_prompts():
    from pathlib import Path

    cfg = load_data_config(Path(__file__).resolve().parents[2] / "configs/data/builtin.yaml")
    assert cfg.source == "builtin" and cfg.task == "builtin"
    records = load_dataset(cfg).records
    assert len(records) == cfg.builtin.num_prompts
    assert [r.prompt for r in records[:5]] == [r.prompt for r in builtin_records(cfg.builtin)[:5]]
    assert builtin_records(BuiltinTaskConfig(num_prompts=3))[0].prompt == records[0].prompt


def test_tokenizer_round_trips_and_keeps_prompts_short(tmp_path):
    build_builtin_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len(tok) < 128
    records = builtin_prompts(500, seed=0)
    lengths = [len(encode_prompt(tok, r.messages)) for r in records]
    assert max(lengths) < 32
    for r in records[:50]:
        ids = encode_prompt(tok, r.messages)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == r.prompt
        answer = reference_solution(r)
        answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
        assert len(answer_ids) == len(answer)  # one token per character
        assert tok.decode(answer_ids + [tok.eos_token_id], skip_special_tokens=True) == answer
    assert tok.unk_token_id in tok("é")["input_ids"]
