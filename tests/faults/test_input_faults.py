"""Bad datasets stop the launcher in one line before any process starts.

``launch.train.main`` runs in-process on a real file dataset (the GSM8K preset's columns and
template) with the embedded policy and its tokenizer: exit 2, one line naming the file and the
line, no ``run_config.yaml``, no child. They used to surface 16-30 s into the run inside the
rollout worker (a bare ``UnicodeDecodeError``, "0 prompts cannot be split into 1 shards"), or
not at all (a prompt past the context trained; a 1 MB one took the worker to 21.7 GB).
"""

from __future__ import annotations

import json

import pytest

from launch import train

ROW = {"question": "Tom has 2 apples and buys 2 more. How many apples does he have?", "answer": "#### 4"}
OVERRIDES = ["experiment=smoke", "data=gsm8k", "loop.steps=2", "loop.receive_timeout_s=30"]


def _line(row: dict) -> bytes:
    return json.dumps(row).encode() + b"\n"


def _long(chars: int) -> bytes:
    return _line({**ROW, "question": "x" * chars})


CASES = {  # name -> (file contents, what the one line must say)
    "not UTF-8": (_line(ROW) + b'{"question": "caf\xe9 prices", "answer": "#### 4"}\n',
                  "data.jsonl:2: not UTF-8 (byte 0xe9 at column 18)"),
    "empty file": (b"", "data.jsonl is empty: cluster.rollout_workers=1 need at least one prompt each"),
    "prompt longer than the context": (_line(ROW) + _long(300), "data.jsonl:2: prompt of"),
    "1 MB prompt": (_line(ROW) * 2 + _long(1 << 20), "data.jsonl:3: prompt of"),
    # the reward's check, which the launcher hands the loader (data imports no reward code)
    "math reference without an answer": (_line(ROW) + _line({**ROW, "answer": "sold 48 clips ####"}),
                                         "data.jsonl:2: field 'answer': math reference has no answer"),
}


@pytest.mark.fault(kind="input", name="bad dataset file")
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_dataset_stops_the_launcher_naming_file_and_line(tmp_path, capsys, case, fault_record):
    """The launcher exits 2 with one line naming the file and line (and the prompt budget) before any process starts."""
    data, needle = CASES[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(data)
    run_dir = tmp_path / "run"
    code = train.main([*OVERRIDES, f"data.path={path}", f"loop.run_dir={run_dir}"])
    err = capsys.readouterr().err
    refusal = [line for line in err.splitlines() if line.startswith("launch.train:")]
    assert code == 2 and len(refusal) == 1 and needle in refusal[0], (code, err[-3000:])
    assert "Traceback" not in err and not (run_dir / "run_config.yaml").exists() and not (run_dir / "logs").exists()
    if "prompt of" in needle:
        assert "tokens is longer than the 216 a prompt may have (the model's max_position_embeddings=256 - " \
               "sampling.max_new_tokens=40)" in refusal[0] and "data.overlong_prompts=drop" in refusal[0]
    fault_record["observed"] = refusal[0].replace(str(tmp_path), "<tmp>")[:240]


@pytest.mark.fault(kind="input", name="over-long prompts with data.overlong_prompts=drop")
def test_dropped_over_long_prompts_are_counted_and_the_workers_drop_the_same(tmp_path, fault_record):
    """The launcher counts and names the dropped prompts; a rollout worker's prompt source holds exactly the others."""
    from transformers import AutoTokenizer

    from launch.config import load_run_config
    from launch.preflight import max_positions
    from launch.validate import check_inputs
    from megatron_darl.loop.rollout_loop import build_prompt_source

    path = tmp_path / "data.jsonl"
    path.write_bytes(_line(ROW) + _long(300) + _line(ROW) + _long(5000))
    cfg = train.prepare(load_run_config([*OVERRIDES, f"data.path={path}", "data.overlong_prompts=drop",
                                         f"loop.run_dir={tmp_path / 'run'}"]), log_fn=lambda *_: None)
    said: list[str] = []
    assert check_inputs(cfg, max_positions(cfg), say=said.append) == 2
    assert len(said) == 1 and "2 of 4 prompts are longer than 216 tokens and dropped" in said[0]
    assert f"(first: {path}:2 (" in said[0]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    source, num_prompts = build_prompt_source(cfg, tokenizer, 0, max_positions(cfg))
    seen = {source.next().record.source for _ in range(num_prompts)}
    assert num_prompts == 2 and seen == {f"{path}:1", f"{path}:3"}
    fault_record["observed"] = "launcher: '2 of 4 prompts are longer than 216 tokens and dropped (first: <tmp>/data.jsonl:2 (...))'; the worker's shard holds lines 1 and 3"
