"""Evaluation harness: pass@k against hand-computed values, avg@n/pass@k through a scripted
engine (the harness is what is under test), result files, benchmark file resolution, Megatron
checkpoint detection, and tools/eval.py end to end on a tiny random Qwen3."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_darl.data import build_builtin_tokenizer, builtin_prompts, reference_solution
from megatron_darl.data.records import PromptRecord
from megatron_darl.checkpoint import hf_dir
from megatron_darl.checkpoint.hf_dir import is_megatron_checkpoint, resolve_hf_dir
from megatron_darl.eval.benchmarks import load_benchmark_table, resolve_benchmark
from megatron_darl.eval.harness import evaluate_benchmark, write_results
from megatron_darl.eval.metrics import avg_at_n, default_ks, mean_pass_at_k, pass_at_k
from megatron_darl.eval.config import BenchmarkConfig, EvalConfig
from megatron_darl.rollout.config import SamplingConfig
from megatron_darl.rollout.engines.base import Generation

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("DARL_BENCHMARK_DIR", REPO.parent / "shared" / "data" / "benchmarks"))


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25),
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (10, 0, 5, 0.0),
    (4, 2, 3, 1.0),  # n - c < k: every draw of 3 holds a correct one
    (3, 3, 1, 1.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    n, c, k = 2000, 37, 1000
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, then one division
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)
    assert pass_at_k(2000, 0, 1) == 0.0


def test_metric_errors_and_defaults():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        avg_at_n([])
    assert default_ks(16) == [1, 2, 4, 8, 16]
    assert default_ks(6) == [1, 2, 4, 6]
    assert mean_pass_at_k([4, 1, 0], 4, 2) == pytest.approx((1 + 0.5 + 0) / 3)
    with pytest.raises(ValueError, match="ks"):
        EvalConfig(n=4, ks=[8])


class ScriptedEngine:
    """Implements the Engine protocol with fixed texts: ``script[prompt_text]`` -> n responses."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tok, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Generation]]:
        self.calls.append((len(prompts), sampling))
        out = []
        for ids in prompts:
            texts = self.script[self.tok.decode(ids, skip_special_tokens=True)]
            assert len(texts) == sampling.n
            gens = []
            for text in texts:
                tokens = self.tok(text, add_special_tokens=False)["input_ids"]
                truncated = len(tokens) >= sampling.max_new_tokens
                tokens = tokens[: sampling.max_new_tokens] + ([] if truncated else [self.tok.eos_token_id])
                gens.append(Generation(torch.tensor(tokens), torch.zeros(len(tokens)),
                                       "length" if truncated else "stop"))
            out.append(gens)
        return out

    def load_weights(self, named_tensors) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_builtin_tokenizer(tmp_path_factory.mktemp("tok"))


def test_builtin_benchmark_avg_and_pass_at_k(tokenizer, tmp_path):
    records = builtin_prompts(3, seed=0)
    right = [reference_solution(r) for r in records]
    script = {
        records[0].prompt: [right[0]] * 4,  # 4 of 4
        records[1].prompt: [right[1], "answer: 999", "answer: 998", "garbage"],  # 1 of 4
        records[2].prompt: ["answer: 999"] * 4,  # 0 of 4
    }
    engine = ScriptedEngine(tokenizer, script)
    cfg = EvalConfig(n=4, batch_prompts=2, max_new_tokens=64, progress=False, temperature=1.0)
    result = evaluate_benchmark("builtin", records, engine, tokenizer, cfg, tmp_path / "s.jsonl")
    assert result.num_prompts == 3 and result.task == "builtin"
    assert result.avg_at_n == pytest.approx((1 + 0.25 + 0) / 3)
    assert result.pass_at_k == pytest.approx({"pass@1": 1.25 / 3, "pass@2": 1.5 / 3, "pass@4": 2 / 3})
    assert [c[0] for c in engine.calls] == [2, 1]  # batches of batch_prompts
    assert engine.calls[0][1].n == 4 and engine.calls[0][1].temperature == 1.0
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert rows[1]["rewards"] == [1.0, 0.0, 0.0, 0.0] and rows[1]["responses"][0] == right[1]


def test_math_benchmark_truncation_limit_and_progress(tokenizer, capsys):
    records = [PromptRecord(i, f"q{i}", [{"role": "user", "content": f"q{i}"}], "gsm8k",
                            reference=f"work\n#### {i + 1}") for i in range(3)]
    script = {"q0": ["\\boxed{1}", "x" * 50], "q1": ["#### 2", "#### 2"], "q2": ["no", "no"]}
    cfg = EvalConfig(n=2, max_new_tokens=20, limit=2, progress=True)
    result = evaluate_benchmark("gsm", records, ScriptedEngine(tokenizer, script), tokenizer, cfg)
    assert result.num_prompts == 2
    assert result.avg_at_n == pytest.approx((0.5 + 1.0) / 2)
    assert result.truncated_fraction == pytest.approx(1 / 4)
    assert "gsm" in capsys.readouterr().err  # the tqdm bar


def test_results_json_and_markdown(tokenizer, tmp_path):
    records = builtin_prompts(2, seed=1)
    script = {r.prompt: [reference_solution(r), "answer: 1000"] for r in records}
    cfg = EvalConfig(n=2, progress=False)
    result = evaluate_benchmark("builtin", records, ScriptedEngine(tokenizer, script), tokenizer, cfg)
    json_path, md_path = write_results([result], tmp_path / "out", {"model": "m"})
    payload = json.loads(json_path.read_text())
    assert payload["model"] == "m"
    assert payload["results"]["builtin"]["pass_at_k"] == {"pass@1": 0.5, "pass@2": 1.0}
    md = md_path.read_text()
    assert "| builtin | 2 | 2 | 50.00 | 50.00 | 100.00 |" in md


def test_benchmark_table_and_missing_file_names_the_flag(tmp_path):
    table = load_benchmark_table(REPO / "configs/eval/benchmarks.yaml")
    assert set(table) == {"gsm8k", "math500", "aime24", "aime25", "humaneval", "livecodebench"}
    with pytest.raises(FileNotFoundError, match=r"aime25/test\.jsonl.*--aime25-path"):
        resolve_benchmark("aime25", table["aime25"], REPO / "configs/data", tmp_path)
    (tmp_path / "a.jsonl").write_text(json.dumps({"problem": "p", "answer": "3", "id": 1}) + "\n")
    cfg = resolve_benchmark("aime25", table["aime25"], REPO / "configs/data", tmp_path,
                            override=str(tmp_path / "a.jsonl"))
    assert (cfg.name, cfg.task, cfg.path) == ("aime25", "math", str(tmp_path / "a.jsonl"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("benchmarks:\n  x: {data: gsm8k}\n")
    with pytest.raises(ValueError, match="benchmarks.x"):
        load_benchmark_table(bad)
    assert isinstance(table["gsm8k"], BenchmarkConfig)


def test_megatron_checkpoint_is_detected_and_converted(tmp_path, monkeypatch):
    hf = tmp_path / "hf_model"
    hf.mkdir()
    assert resolve_hf_dir(hf, tmp_path / "t1", tmp_path / "none.py") == hf
    meg = tmp_path / "meg"
    meg.mkdir()
    (meg / "megatron_darl.json").write_text("{}")
    assert is_megatron_checkpoint(meg) and not is_megatron_checkpoint(hf)
    with pytest.raises(ValueError, match=f"checkpoint {meg} has no tokenizer"):  # before any conversion
        resolve_hf_dir(meg, tmp_path / "t0", tmp_path / "none.py")
    (meg / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="converter"):
        resolve_hf_dir(meg, tmp_path / "t2", tmp_path / "none.py")
    fake = tmp_path / "convert.py"
    fake.write_text("import argparse, pathlib\np = argparse.ArgumentParser()\n"
                    "p.add_argument('--megatron-dir'); p.add_argument('--out-dir')\n"
                    "a = p.parse_args()\nout = pathlib.Path(a.out_dir); out.mkdir(parents=True)\n"
                    "(out / 'from.txt').write_text(a.megatron_dir)\n")
    out = resolve_hf_dir(meg, tmp_path / "t3", fake)
    assert (out / "from.txt").read_text() == str(meg)
    fake.write_text("raise SystemExit('boom')")
    with pytest.raises(RuntimeError, match="boom"):
        resolve_hf_dir(meg, tmp_path / "t4", fake)
    fake.write_text("import time\ntime.sleep(60)\n")  # a conversion on a stalled filesystem
    monkeypatch.setattr(hf_dir, "CONVERT_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match=r"did not end within 0 s .*stalled filesystem"):
        resolve_hf_dir(meg, tmp_path / "t6", fake)
    with pytest.raises(FileNotFoundError, match="--model"):
        resolve_hf_dir(tmp_path / "nowhere", tmp_path / "t5", fake)


def _tiny_qwen3(out_dir: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    tok = build_builtin_tokenizer(out_dir)
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_theta": 1e6}, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def _eval_tool(monkeypatch):
    gsm8k = BENCH / "gsm8k" / "test.jsonl"
    if not gsm8k.is_file():
        pytest.skip(f"benchmark file {gsm8k} not present (set DARL_BENCHMARK_DIR)")
    pytest.importorskip("megatron_darl.rollout.engines.hf")
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import eval as eval_tool  # tools/eval.py

    return eval_tool, gsm8k


def test_tools_eval_end_to_end_on_a_tiny_qwen3(tmp_path, monkeypatch):
    eval_tool, gsm8k = _eval_tool(monkeypatch)
    model = _tiny_qwen3(tmp_path / "model")

    out = tmp_path / "out"
    rc = eval_tool.main(["--model", str(model), "--benchmarks", "gsm8k", "--n", "2", "--limit", "3",
                         "--max-new-tokens", "6", "--benchmark-dir", str(BENCH), "--out-dir", str(out),
                         "--device", "cpu", "--no-progress"])
    assert rc == 0
    payload = json.loads((out / "results.json").read_text())
    res = payload["results"]["gsm8k"]
    assert res["num_prompts"] == 3 and res["n"] == 2
    assert 0.0 <= res["avg_at_n"] <= 1.0 and set(res["pass_at_k"]) == {"pass@1", "pass@2"}
    assert 0 < res["mean_response_tokens"] <= 6
    assert payload["files"]["gsm8k"] == str(gsm8k)
    assert "| gsm8k | 3 | 2 |" in (out / "results.md").read_text()
    assert len((out / "samples_gsm8k.jsonl").read_text().splitlines()) == 3
    rc = eval_tool.main(["--model", str(model), "--benchmarks", "aime25", "--benchmark-dir", str(tmp_path)])
    assert rc == 2  # missing file: a clear error, no traceback


@pytest.mark.slow
def test_tools_eval_on_a_megatron_checkpoint_matches_its_hf_source(tmp_path, monkeypatch):
    """Greedy samples from the Megatron checkpoint (converted back on the fly) equal the HF ones."""
    import subprocess

    eval_tool, _ = _eval_tool(monkeypatch)
    converter = REPO / "tools" / "convert_hf_to_megatron.py"
    if not converter.is_file():
        pytest.skip("tools/convert_hf_to_megatron.py not present")
    hf = _tiny_qwen3(tmp_path / "hf")
    meg = tmp_path / "meg"
    proc = subprocess.run([sys.executable, str(converter), "--hf-dir", str(hf), "--out-dir", str(meg),
                           "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert is_megatron_checkpoint(meg)
    common = ["--benchmarks", "gsm8k", "--n", "1", "--limit", "2", "--max-new-tokens", "5",
              "--temperature", "0", "--benchmark-dir", str(BENCH), "--device", "cpu", "--no-progress"]
    assert eval_tool.main(["--model", str(hf), "--out-dir", str(tmp_path / "a"), *common]) == 0
    assert eval_tool.main(["--model", str(meg), "--out-dir", str(tmp_path / "b"), *common]) == 0
    samples = [[json.loads(line)["responses"] for line in (tmp_path / d / "samples_gsm8k.jsonl").open()]
               for d in ("a", "b")]
    assert samples[0] == samples[1] and len(samples[0]) == 2
    assert json.loads((tmp_path / "b" / "results.json").read_text())["model"] == str(meg)
