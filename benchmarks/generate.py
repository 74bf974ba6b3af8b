"""Benchmark ``generate``: ``hf`` engine tokens/s at 64 and 256 concurrent sequences, 1.7B shapes.

Random-init Qwen3-1.7B shapes (bf16 on GPU, static cache + torch.compile via ``EngineConfig.compile``);
every sequence generates exactly ``--new-tokens`` tokens (no stop token), so tokens/s =
concurrency * new_tokens / seconds of the timed call (after a warm-up call that compiles).

    python benchmarks/generate.py                # GPU
    python benchmarks/generate.py --tiny         # CPU smoke check
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402
from benchmarks.weight_sync import build_model  # noqa: E402
from megatron_darl.rollout.engines import EngineConfig, SamplingConfig  # noqa: E402
from megatron_darl.rollout.engines.hf import HFEngine  # noqa: E402


def run(engine: HFEngine, concurrency: int, prompt_tokens: int, new_tokens: int) -> float:
    """Seconds for one generate call of ``concurrency`` sequences."""
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_tokens,)).tolist() for _ in range(concurrency)]
    sampling = SamplingConfig(n=1, max_new_tokens=new_tokens, temperature=1.0, seed=0)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert all(g[0].logprobs.numel() == g[0].token_ids.numel() for g in out)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1.7b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    if a.tiny:
        a.model, a.concurrency, a.prompt_tokens, a.new_tokens = "tiny", [4, 8], 16, 16
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(a.model, device, dtype)
    model.config.eos_token_id = None  # fixed-length generations: tokens/s is well defined
    rows = []
    for conc in a.concurrency:
        engine = HFEngine(EngineConfig(device=str(device), max_batch_size=conc, compile=not a.no_compile), model=model)
        run(engine, conc, a.prompt_tokens, a.new_tokens)  # warm-up (compiles on GPU)
        seconds = run(engine, conc, a.prompt_tokens, a.new_tokens)
        metrics = {"tokens_per_s": conc * a.new_tokens / seconds, "seconds": seconds}
        config = {"model": a.model, "concurrency": conc, "prompt_tokens": a.prompt_tokens,
                  "new_tokens": a.new_tokens, "compile": device.type == "cuda" and not a.no_compile,
                  "dtype": str(dtype).removeprefix("torch.")}
        rows.append({**config, **metrics})
        write_result("generate", config, metrics)
    print_table(rows)


if __name__ == "__main__":
    main()
