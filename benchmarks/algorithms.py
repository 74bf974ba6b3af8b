"""Cost of the D-ARL algorithm core per step: score + select + multi-behavior weights + loss.

The D-ARL additions (chi-square score over every candidate, selection, mixture weights over K
versions, and the weighted clipped loss with its backward) must be negligible next to the
train step they feed. This script times them on CPU for the production batch, 512 prompts x 16
samples x 4096 response tokens (33.5M tokens, K = 4 versions), and compares with the model
FLOPs of one Qwen3-1.7B train step on the same tokens (6 * 1.7e9 * tokens, attention and the
log-prob pass left out, so the step estimate is a lower bound) at 0.45 MFU on one H100
(989 TFLOP/s dense bf16). On the GPU the algorithm core would be faster still: it is a few
memory-bound elementwise passes over (K, N, T) tensors.

    python benchmarks/algorithms.py            # full size (about 3 GB of host memory)
    python benchmarks/algorithms.py --small    # 64 x 8 x 512 smoke run (128x fewer tokens)

One thread by default: on a shared CPU, extra OpenMP threads spin against other jobs and make
timings several times worse (and noisy); the single-thread time is an upper bound.

Writes ``benchmarks/results/algorithms_*.json`` with metric ``seconds`` (total per step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.record import print_table, write_result  # noqa: E402
from megatron_darl.algorithms import (  # noqa: E402
    batch_behavior_weights,
    group_scores,
    policy_loss,
    score_samples,
    select_groups,
)

H100_DENSE_BF16_FLOPS = 989e12
MFU = 0.45
PARAMS_1P7B = 1.7e9


def make_inputs(prompts: int, samples: int, tokens: int, k: int, seed: int = 0) -> dict:
    """Synthetic batch: N = prompts * samples responses of up to ``tokens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    n = prompts * samples
    lengths = torch.randint(tokens // 4, tokens + 1, (n,), generator=g)  # (N,)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]  # (N, T)
    logp_by_version = -2.0 * torch.rand(k, n, tokens, generator=g)  # (K, N, T)
    group_version = torch.randint(0, k, (prompts,), generator=g)  # (P,) index into versions
    behavior = group_version.repeat_interleave(samples)  # (N,)
    own = logp_by_version[behavior, torch.arange(n)]  # (N, T) engine log-probs
    logp_current = own + 0.05 * torch.randn(n, tokens, generator=g)  # (N, T)
    return {
        "logp_current": logp_current, "logp_by_version": logp_by_version, "own": own,
        "mask": mask, "behavior": behavior, "versions": torch.arange(k),
        "group_index": torch.arange(prompts).repeat_interleave(samples),
        "advantages": torch.randn(n, generator=g), "prompts": prompts,
    }


def run_once(x: dict) -> dict[str, float]:
    """One step of the algorithm core; seconds per phase."""
    t0 = time.perf_counter()
    sample_scores = score_samples("chi2", x["logp_current"], x["own"], x["mask"])  # (N,)
    scores = group_scores(sample_scores, x["mask"].sum(1), x["group_index"], x["prompts"])
    t1 = time.perf_counter()
    fresh = torch.arange(x["prompts"], dtype=torch.float64)
    chosen = select_groups(scores, torch.ones_like(scores, dtype=torch.bool), x["prompts"], fresh)
    t2 = time.perf_counter()
    assert chosen.numel() == x["prompts"]
    bw = batch_behavior_weights("darl", x["logp_current"], x["logp_by_version"], x["versions"],
                                x["behavior"], x["mask"], clip=2.0)
    t3 = time.perf_counter()
    logp_new = (x["logp_current"] + 0.01).requires_grad_()
    loss, stats = policy_loss(logp_new, bw.logp_base, bw.weights, x["advantages"], x["mask"])
    loss.backward()
    t4 = time.perf_counter()
    assert torch.isfinite(loss) and 0 < stats.weight_ess.item() <= 1
    return {"score_s": t1 - t0, "select_s": t2 - t1, "weights_s": t3 - t2,
            "loss_fwd_bwd_s": t4 - t3, "seconds": t4 - t0}


def train_step_seconds(num_tokens: int) -> float:
    """Lower bound on a Qwen3-1.7B train step over ``num_tokens`` tokens at 0.45 MFU on an H100."""
    return 6 * PARAMS_1P7B * num_tokens / (H100_DENSE_BF16_FLOPS * MFU)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="64 x 8 x 512 smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="runs; the fastest is kept")
    parser.add_argument("--k", type=int, default=4, help="behavior versions in the batch")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: reproducible on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts, samples, tokens = (64, 8, 512) if args.small else (512, 16, 4096)
    repeats = args.repeats or (3 if args.small else 2)
    x = make_inputs(prompts, samples, tokens, args.k)
    best = min((run_once(x) for _ in range(repeats)), key=lambda r: r["seconds"])
    num_tokens = prompts * samples * tokens
    step = train_step_seconds(num_tokens)
    metrics = {**best, "train_step_estimate_s": step,
               "fraction_of_train_step": best["seconds"] / step}
    config = {"prompts": prompts, "samples": samples, "tokens": tokens, "k": args.k,
              "threads": torch.get_num_threads(), "small": args.small, "repeats": repeats,
              "load_avg_1min": round(os.getloadavg()[0], 2)}  # shared CPU: timings are noisy
    print_table([{**config, **metrics}])
    print(f"\nalgorithm core on CPU: {best['seconds']:.2f} s for {num_tokens / 1e6:.1f}M tokens; "
          f"a Qwen3-1.7B train step on the same tokens is >= {step:.0f} s on an H100 at "
          f"{MFU:.2f} MFU, so the core is {100 * best['seconds'] / step:.2f}% of it "
          f"({step / best['seconds']:.0f}x smaller)")
    print(f"wrote {write_result('algorithms', config, metrics)}")


if __name__ == "__main__":
    main()
