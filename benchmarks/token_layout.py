"""Benchmark ``token_layout``: the loop's per-token math in the packed layout vs padded rows.

The planner keeps one token layout from the log-prob pass to the loss (``step/sequences.py``).
This measures the two candidates on the same step: N responses with long-tailed lengths (RL
responses: most short, a few at the limit; log-normal, clipped to ``--max-len``), K = 4 window
versions, and the work a D-ARL step does per token: the chi2 score, the mixture behavior
weights and the clipped loss with its backward. ``padded`` holds every per-token tensor as
``(N, T_max)`` (``(K, N, T_max)`` for the cache rows) with a mask; ``packed`` holds ``(n,)``
(``(K, n)``), n = the real tokens. Reported: seconds of each part, the bytes of the per-token
tensors of the step, and the padding factor ``N * T_max / n``.

    python benchmarks/token_layout.py                       # N=512, max 8192 tokens
    python benchmarks/token_layout.py --samples 64 --max-len 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402
from megatron_darl.algorithms import (  # noqa: E402
    batch_behavior_weights, policy_loss, score_samples, score_tokens,
)

K = 4


def lengths(n: int, max_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    draw = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 0.9 + torch.log(torch.tensor(max_len / 8)))
    return draw.clamp(16, max_len).long()  # (N,)


def inputs(lens: torch.Tensor, seed: int) -> dict:
    """Packed per-token inputs of one step: pi_t, the K cache rows, advantages, versions."""
    g = torch.Generator().manual_seed(seed)
    n = int(lens.sum())
    base = -torch.rand(n, generator=g) * 3
    by_version = torch.stack([base + 0.05 * k * torch.randn(n, generator=g) for k in range(K)])  # (K, n)
    sample_version = torch.randint(0, K, (lens.numel(),), generator=g)
    return {"lc": base, "by_version": by_version, "sample_version": sample_version,
            "adv": torch.randn(lens.numel(), generator=g)}


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_packed(lens: torch.Tensor, x: dict) -> tuple[dict, int]:
    n, versions = int(lens.sum()), torch.arange(K)
    index = torch.repeat_interleave(torch.arange(lens.numel()), lens)  # (n,)
    bv = x["sample_version"][index]  # (n,)
    lb = x["by_version"].gather(0, bv[None])[0]  # (n,) each token's own behavior row
    t = {}
    start = time.perf_counter()
    score_tokens("chi2", x["lc"], lb, index, lens.numel(), x["sample_version"])
    t["score_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    bw = batch_behavior_weights("darl", x["lc"], x["by_version"], versions, bv, torch.ones(n, dtype=torch.bool))
    t["weights_seconds"] = time.perf_counter() - start
    adv = x["adv"][index]
    logp = (x["lc"] + 0.01).requires_grad_()
    start = time.perf_counter()
    loss, _ = policy_loss(logp, bw.logp_base, bw.weights, adv, None, num_tokens=1.0)
    loss.backward()
    t["loss_seconds"] = time.perf_counter() - start
    held = _bytes(x["lc"], x["by_version"], lb, bv, bw.weights, bw.logp_base, adv, logp, logp.grad)
    return t, held


def run_padded(lens: torch.Tensor, x: dict) -> tuple[dict, int]:
    n_seq, t_max = lens.numel(), int(lens.max())
    mask = torch.arange(t_max)[None, :] < lens[:, None]  # (N, T)

    def pad(flat: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*flat.shape[:-1], n_seq, t_max, dtype=flat.dtype)
        out[..., mask] = flat
        return out

    lc, by_version, versions = pad(x["lc"]), pad(x["by_version"]), torch.arange(K)  # (N,T), (K,N,T)
    lb = by_version.gather(0, x["sample_version"].view(1, -1, 1).expand(1, n_seq, t_max))[0]
    t = {}
    start = time.perf_counter()
    score_samples("chi2", lc, lb, mask, x["sample_version"])
    t["score_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    bw = batch_behavior_weights("darl", lc, by_version, versions, x["sample_version"], mask)
    t["weights_seconds"] = time.perf_counter() - start
    logp = (lc + 0.01).requires_grad_()
    start = time.perf_counter()
    loss, _ = policy_loss(logp, bw.logp_base, bw.weights, x["adv"], mask, num_tokens=1.0)
    loss.backward()
    t["loss_seconds"] = time.perf_counter() - start
    held = _bytes(lc, by_version, lb, mask, bw.weights, bw.logp_base, logp, logp.grad)
    return t, held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=512, help="responses per step (N)")
    p.add_argument("--max-len", type=int, default=8192, help="response length limit")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    lens = lengths(a.samples, a.max_len, a.seed)
    x = inputs(lens, a.seed)
    rows, config = [], {"samples": a.samples, "max_len": a.max_len, "versions": K,
                        "tokens": int(lens.sum()), "t_max": int(lens.max())}
    for layout, fn in (("packed", run_packed), ("padded", run_padded)):
        runs = [fn(lens, x) for _ in range(a.repeats)]
        best = {k: min(r[0][k] for r in runs) for k in runs[0][0]}
        metrics = {**best, "seconds": sum(best.values()), "bytes": runs[0][1],
                   "padding_factor": a.samples * int(lens.max()) / int(lens.sum())}
        rows.append({"layout": layout, **metrics})
        print(write_result("token_layout", {**config, "layout": layout}, metrics))
    print_table(rows)


if __name__ == "__main__":
    main()
