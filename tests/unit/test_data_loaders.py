"""Dataset loading: jsonl/jsonl.gz/parquet through the field mapping, malformed rows named by
file and line (or skipped and counted), the shipped presets, LiveCodeBench test decoding and the
chat template with its plain fallback."""

import base64
import gzip
import json
import os
import pickle
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_darl.data import (
    DataConfig,
    FieldMapConfig,
    MalformedRowError,
    TemplateConfig,
    build_builtin_tokenizer,
    encode_prompt,
    load_data_config,
    load_dataset,
    load_records,
    render_prompt,
)
from megatron_darl.data.testcases import decode_cases

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("DARL_BENCHMARK_DIR", REPO.parent / "shared" / "data" / "benchmarks"))
ROWS = [{"q": "1+1?", "a": "2", "id": "x1", "level": 1}, {"q": "2+2?", "a": "4", "id": "x2", "level": 3}]


def _cfg(path, **kw) -> DataConfig:
    fields = FieldMapConfig(prompt="q", reference="a", id="id", metadata=["level"])
    return DataConfig(name="t", task="math", source="file", path=str(path), fields=fields, **kw)


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_gz_and_parquet_give_the_same_records(tmp_path):
    jl = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in ROWS])
    gz = tmp_path / "d.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(jl.read_text())
    pqf = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), pqf)
    loaded = [load_records(_cfg(p)).records for p in (jl, gz, pqf)]
    assert loaded[0] == loaded[1] == loaded[2]
    r = loaded[0][1]
    assert (r.prompt_id, r.prompt, r.reference, r.task) == (1, "2+2?", "4", "math")
    assert r.metadata == {"level": 3, "source_id": "x2"}
    assert r.messages == [{"role": "user", "content": "2+2?"}]


def test_template_builds_system_and_user_messages(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0])])
    cfg = _cfg(path, template=TemplateConfig(system="Be brief.", user="Q{level}: {prompt} \\boxed{{}}"))
    messages = load_records(cfg).records[0].messages
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Q1: 1+1? \\boxed{}"}]


@pytest.mark.parametrize("bad_line, message", [
    ('{"q": "3+3?", "a": "6"', "invalid JSON"),
    ('["not", "an", "object"]', "row is a list"),
    ('{"a": "6"}', "field 'q' is missing"),
    ('{"q": "  ", "a": "6"}', "field 'q' is missing or empty"),
    ('{"q": "3+3?"}', "field 'a' is missing"),
])
def test_malformed_row_names_file_line_and_field(tmp_path, bad_line, message):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), "", bad_line, json.dumps(ROWS[1])])
    with pytest.raises(MalformedRowError, match=message) as info:
        load_records(_cfg(path))
    assert f"{path}:3:" in str(info.value)  # the blank line 2 still counts


def test_malformed_rows_are_skipped_and_counted_when_configured(tmp_path):
    lines = [json.dumps(ROWS[0]), "{oops", '{"a": 1}', json.dumps(ROWS[1])]
    result = load_records(_cfg(_write_jsonl(tmp_path / "d.jsonl", lines), skip_malformed=True))
    assert [r.prompt for r in result.records] == ["1+1?", "2+2?"]
    assert [r.prompt_id for r in result.records] == [0, 1]
    assert result.skipped == 2 and result.skipped_lines == [2, 3]


def test_parquet_malformed_row_names_the_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([ROWS[0], {"q": None, "a": "1", "id": "z", "level": 0}]), path)
    with pytest.raises(MalformedRowError, match=r"d\.parquet:2: field 'q'"):
        load_records(_cfg(path))


def test_missing_and_unsupported_files_and_bad_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_records(_cfg(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("q,a\n")
    with pytest.raises(ValueError, match="unsupported format"):
        load_records(_cfg(tmp_path / "d.csv"))
    with pytest.raises(ValueError, match="data.source"):
        DataConfig(source="web")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_data_config(tmp_path / "missing.yaml")


def test_max_records(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in ROWS])
    assert len(load_records(_cfg(path, max_records=1)).records) == 1


def _lcb_blob(cases: list[dict]) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


def test_livecodebench_cases_plain_and_compressed(tmp_path):
    public = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    private = [{"input": "5\n", "output": "6\n", "testtype": "stdin"},
               {"input": "f(1)", "output": "2", "testtype": "functional"}]
    rows = [{"question_content": "add one", "question_id": "q1", "public_test_cases": json.dumps(public),
             "private_test_cases": _lcb_blob(private), "platform": "atcoder", "difficulty": "easy",
             "contest_date": "2024-01-01"},
            {"question_content": "call f", "question_id": "q2",
             "public_test_cases": json.dumps([private[1]]), "private_test_cases": ""}]
    path = _write_jsonl(tmp_path / "lcb.jsonl", [json.dumps(r) for r in rows])
    cfg = load_data_config(REPO / "configs/data/livecodebench.yaml", {"path": str(path)})
    result = load_records(cfg)
    assert result.skipped == 1  # functional-only problem
    record = result.records[0]
    assert record.task == "stdio"
    assert record.tests == [{"input": "1\n", "output": "2\n"}, {"input": "5\n", "output": "6\n"}]
    assert record.metadata["source_id"] == "q1" and record.metadata["platform"] == "atcoder"


def test_compressed_cases_refuse_pickled_objects():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    blob = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        decode_cases(blob, livecodebench=True)


def test_every_preset_loads_its_shared_file_or_names_it(monkeypatch):
    monkeypatch.setenv("DARL_BENCHMARK_DIR", str(BENCH))
    monkeypatch.delenv("DARL_LIVECODEBENCH_PATH", raising=False)
    presets = sorted((REPO / "configs" / "data").glob("*.yaml"))
    assert {p.stem for p in presets} >= {"gsm8k", "math", "aime", "humaneval", "livecodebench", "builtin"}
    for preset in presets:
        cfg = load_data_config(preset)
        if cfg.source == "file" and not Path(cfg.path).is_file():
            with pytest.raises(FileNotFoundError, match=Path(cfg.path).name):
                load_dataset(cfg)
            continue
        result = load_dataset(cfg)
        assert result.records and result.skipped == 0, preset.name
        assert all(r.task == cfg.task and r.messages[-1]["role"] == "user" for r in result.records)


class _TemplateTokenizer:
    """Stands in for an instruct tokenizer: has a chat template, records the call."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **extra):
        assert tokenize is False and add_generation_prompt is True
        self.extra = extra
        return "<|im_start|>" + "|".join(m["content"] for m in messages) + "<|assistant|>"

    def __call__(self, text, add_special_tokens):
        self.add_special_tokens = add_special_tokens
        return {"input_ids": [ord(c) for c in text]}


def test_chat_template_is_used_when_present():
    tok = _TemplateTokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_prompt(tok, msgs, enable_thinking=False) == "<|im_start|>S|U<|assistant|>"
    assert tok.extra == {"enable_thinking": False}
    ids = encode_prompt(tok, msgs)
    assert tok.add_special_tokens is False and len(ids) == len("<|im_start|>S|U<|assistant|>")


def test_plain_fallback_without_a_chat_template(tmp_path):
    tok = build_builtin_tokenizer(tmp_path / "tok")
    msgs = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    assert render_prompt(tok, msgs) == "Add.\n\n1+2="
    ids = encode_prompt(tok, msgs)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "Add.\n\n1+2="
    with pytest.raises(ValueError, match="no messages"):
        render_prompt(tok, [])
