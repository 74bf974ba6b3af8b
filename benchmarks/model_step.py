"""Forward+backward throughput of Megatron Qwen3 vs HF transformers (sdpa), same GPU, same run.

For each model size (random init, bf16, micro-batch ``--batch`` x ``--seq`` tokens) we time
``loss.backward()`` of the mean next-token cross-entropy, first for our Megatron model (TE layers
when Transformer Engine imports, otherwise local layers + SDPA core attention), then for
``transformers.Qwen3ForCausalLM(attn_implementation="sdpa")``; no optimizer step.

FLOP formula (PaLM appendix B convention), per token of a fwd+bwd pass:
    6 * N  +  12 * L * H * Q * s
N = matmul parameters = non-embedding parameters + vocab * hidden (the LM head matmul, also
when tied); L layers, H query heads, Q head_dim, s sequence length. The attention term counts
the full s x s score matrix (no causal halving), as PaLM and Megatron-LM do; ``mfu_causal``
halves it. MFU = FLOPs / s / peak dense bf16 FLOP/s of the device (H100/H200 SXM: 989 TFLOP/s;
override with ``--peak-tflops``).

    python benchmarks/model_step.py                  # Qwen3-1.7B and 4B at seq 4096 on GPU
    python benchmarks/model_step.py --tiny           # CPU smoke check (tiny shapes, no JSON)
Metrics: ``mfu``, ``tokens_per_s``, ``hf_tokens_per_s`` (+ ``hf_mfu``, ``speedup_vs_hf``...).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.record import device_name, print_table, write_result  # noqa: E402

PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "H800": 989.0,
                    "A100": 312.0, "B200": 2250.0}
TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_parameters={"rope_theta": 1e6},
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096)


def flops_per_token(spec, seq: int, causal: bool = False) -> float:
    """6 * N + 12 * L * H * Q * s (attention halved when ``causal``); see module docstring."""
    h, q, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    attn = h * q * (2 * spec.num_heads + 2 * spec.num_kv_heads)  # q, o, k, v projections
    n = spec.num_layers * (attn + 3 * h * inter) + spec.vocab_size * h
    score = 12 * spec.num_layers * spec.num_heads * q * seq
    return 6 * n + (score / 2 if causal else score)


def peak_flops(override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    name = device_name()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def _time_steps(step, warmup: int, iters: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - start) / iters


def megatron_step_seconds(cfg: dict, args, dtype) -> tuple[float, str, float | None]:
    from megatron_darl.models.qwen3 import build_qwen3_model
    from megatron_darl.models.qwen3.model import resolve_backend
    from megatron_darl.trainer.parallel import destroy_parallel, init_single_process

    ps = init_single_process()
    try:
        backend = resolve_backend(args.attention)
        model = build_qwen3_model(cfg, ps, dtype=dtype, attention=backend)[0].train()
        ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq + 1), device=ps.device)
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        pos = torch.arange(args.seq, device=ps.device).unsqueeze(0).expand(args.batch, -1)
        mask = None
        if model.needs_attention_mask:
            from megatron_darl.models.qwen3 import causal_mask

            mask = causal_mask(args.seq, ps.device)

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(inputs, pos, mask, labels=labels)  # [b, s] per-token CE (fp32)
            loss.float().mean().backward()

        if ps.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = _time_steps(step, args.warmup, args.iters, ps.device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if ps.device.type == "cuda" else None
        del model
        return seconds, backend, peak
    finally:
        destroy_parallel()
        _free()


def hf_sdpa_model(config, dtype: torch.dtype, device):
    """Random-init ``Qwen3ForCausalLM`` with SDPA attention (transformers 4.x and 5.x)."""
    import transformers

    with torch.device(device):
        try:
            return transformers.Qwen3ForCausalLM._from_config(
                config, attn_implementation="sdpa", dtype=dtype)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            return transformers.Qwen3ForCausalLM._from_config(
                config, attn_implementation="sdpa", torch_dtype=dtype)


def hf_step_seconds(cfg: dict, args, dtype, device: torch.device) -> float:
    import transformers

    config = transformers.Qwen3Config(**cfg)
    model = hf_sdpa_model(config, dtype, device).train()
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), device=device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    seconds = _time_steps(step, args.warmup, args.iters, device)
    del model
    _free()
    return seconds


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_one(name: str, cfg: dict, args) -> dict:
    from megatron_darl.models.qwen3 import spec_from_hf

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = spec_from_hf(cfg, name)
    tokens = args.batch * args.seq
    mg_s, backend, peak_gib = megatron_step_seconds(cfg, args, dtype)
    hf_s = None if args.skip_hf else hf_step_seconds(cfg, args, dtype, device)
    peak = peak_flops(args.peak_tflops)
    flops = flops_per_token(spec, args.seq) * tokens
    flops_causal = flops_per_token(spec, args.seq, causal=True) * tokens
    mfu = lambda secs, f=flops: (f / secs / peak) if peak and secs else None  # noqa: E731
    return {
        "model": name, "attention": backend, "tokens_per_s": tokens / mg_s,
        "hf_tokens_per_s": tokens / hf_s if hf_s else None, "mfu": mfu(mg_s),
        "hf_mfu": mfu(hf_s), "mfu_causal": mfu(mg_s, flops_causal),
        "speedup_vs_hf": hf_s / mg_s if hf_s else None, "step_s": mg_s, "hf_step_s": hf_s,
        "peak_gib": peak_gib,  # Megatron run only
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3_1.7b", "qwen3_4b"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (2 x 4096 tokens: >= 0.50 MFU at 1.7B on an H200)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--attention", default="auto", choices=["auto", "te", "sdpa", "local"])
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke check at tiny shapes")
    parser.add_argument("--out-dir", default=None, help="results dir (default benchmarks/results)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from megatron_darl.models.qwen3 import load_preset

    args = parse_args(argv)
    if args.tiny:
        args.models, args.seq, args.warmup, args.iters = ["tiny"], 64, 1, 2
    rows = []
    for name in args.models:
        cfg = dict(TINY) if name == "tiny" else load_preset(name)
        rows.append(bench_one(name, cfg, args))
        if args.tiny and args.out_dir is None:
            continue
        config = {k: getattr(args, k) for k in ("seq", "batch", "warmup", "iters")}
        config.update(model=name, attention=rows[-1]["attention"], init="random",
                      flop_formula="6*N + 12*L*H*Q*s per token (PaLM, non-causal attention)")
        metrics = {k: v for k, v in rows[-1].items() if k not in ("model", "attention")}
        out = write_result("model_step", config, metrics,
                           Path(args.out_dir) if args.out_dir else None)
        print(f"wrote {out}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
