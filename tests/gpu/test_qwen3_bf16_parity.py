"""bf16 parity of Megatron Qwen3 against HF transformers at Qwen3-1.7B shapes (random init).

Both models hold the same random bf16 weights (HF's init, copied through the mapping); we compare
next-token log-probs (fp32 log-softmax of each model's bf16 logits) and report max and mean abs
diff to ``benchmarks/results`` (benchmark ``qwen3_bf16_parity``). bf16 rounding differs between
the two implementations (fused QKV, SDPA kernels, norms), so the bounds are loose sanity bounds;
the fp32 test in tests/distributed is the exact check.

CPU smoke: ``python tests/gpu/test_qwen3_bf16_parity.py --tiny`` (tiny shapes, no JSON).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MEAN_BOUND, MAX_BOUND = 0.05, 1.0  # log-prob (nats); observed values are recorded in the JSON


def _hf_config(preset: str | None):
    import transformers

    from megatron_darl.models.qwen3 import load_preset

    if preset is not None:
        return transformers.Qwen3Config(**load_preset(preset))
    return transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_theta": 1e6}, rms_norm_eps=1e-6, tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    )


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None].to(logp.device)).squeeze(-1)


def run_parity(preset: str | None, batch: int, seq: int, device: str) -> dict[str, float]:
    """Build both models with the same bf16 weights; return log-prob diff statistics."""
    from megatron_darl.models.qwen3 import build_qwen3_model, forward_logits, load_hf_weights
    from megatron_darl.trainer.parallel import destroy_parallel, init_single_process

    cfg = _hf_config(preset)
    torch.manual_seed(0)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.model_step import hf_sdpa_model  # the benchmark's HF reference

    hf = hf_sdpa_model(cfg, torch.bfloat16, device).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    with torch.no_grad():
        ref = _logprobs(hf(ids).logits, ids)
    state = {k: v for k, v in hf.state_dict().items()}
    ps = init_single_process()
    try:
        model = build_qwen3_model(cfg, ps, dtype=torch.bfloat16)
        load_hf_weights(model, state, ps)
        del hf, state
        got = _logprobs(forward_logits(model, ids, ps), ids)
    finally:
        destroy_parallel()
    diff = (got - ref).abs()
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "mean_logprob": float(ref.mean())}


def test_bf16_logprobs_match_hf_at_1p7b_shapes():
    sys.path.insert(0, str(REPO))
    from benchmarks.record import write_result

    metrics = run_parity("qwen3_1.7b", batch=2, seq=1024, device="cuda")
    write_result("qwen3_bf16_parity", {"model": "qwen3_1.7b", "batch": 2, "seq": 1024,
                                       "init": "random", "dtype": "bf16"}, metrics)
    print(metrics)
    assert metrics["mean_abs_diff"] <= MEAN_BOUND, metrics
    assert metrics["max_abs_diff"] <= MAX_BOUND, metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke check)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.tiny:
        print(run_parity(None, batch=2, seq=32, device="cpu"))
    else:
        print(run_parity("qwen3_1.7b", batch=2, seq=1024, device="cuda"))
