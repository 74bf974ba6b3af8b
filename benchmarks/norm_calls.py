"""What one RMSNorm call costs the host and the device, by kernel: the trainer's compiled norm
(``models/qwen3/norm.py``), the same arithmetic eagerly, and torch's native ``F.rms_norm``.

A 1.7B train step at a small micro-batch is host-bound: the device idles between kernels while
the host walks ~8 norm calls a layer forward and back. This times each variant's forward and
backward at the trainer's norm shapes (the hidden norm and the per-head qk-norm of a micro-batch),
as host seconds per call (the loop's launches, no sync inside) and wall seconds per call (synced),
and how many of its bf16 outputs equal the reference's bit for bit. GPU only.

    python benchmarks/norm_calls.py --tokens 5120 --hidden 2048 --heads 16 --head-dim 128
Benchmark name ``norm_calls``; one row per variant and shape: ``host_us``, ``wall_us``,
``same_bits`` (the fraction of outputs equal to the eager reference's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.record import print_table, write_result  # noqa: E402
from megatron_darl.models.qwen3.norm import _fused, rms_norm_reference  # noqa: E402


def variants(eps: float) -> dict:
    return {
        "compiled": lambda x, w: _fused(x, w, eps),
        "eager": lambda x, w: rms_norm_reference(x, w, eps),
        "native": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps),
    }


def time_calls(fn, x: torch.Tensor, w: torch.Tensor, iters: int) -> tuple[float, float]:
    """(host s, wall s) per forward+backward call."""
    grad = torch.randn_like(x)
    for _ in range(5):
        fn(x, w).backward(grad)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn(x, w).backward(grad)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / iters, (time.perf_counter() - start) / iters


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=5120)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--out-dir", default=None, help="results dir (default benchmarks/results)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/norm_calls.py times CUDA kernels: no GPU here")
    shapes = {"hidden": (a.tokens, a.hidden), "qk-norm": (a.tokens, a.heads, a.head_dim)}
    rows = []
    for shape_name, shape in shapes.items():
        w = torch.nn.Parameter(1 + 0.1 * torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16))
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        reference = rms_norm_reference(x, w, a.eps)
        for name, fn in variants(a.eps).items():
            same = (fn(x, w) == reference).float().mean().item()
            host, wall = time_calls(fn, x, w, a.iters)
            rows.append({"variant": name, "shape": shape_name, "host_us": host * 1e6, "wall_us": wall * 1e6,
                         "same_bits": same})
    print_table(rows)
    config = {k: v for k, v in vars(a).items() if k != "out_dir"}
    print(f"wrote {write_result('norm_calls', config, {'rows': rows}, a.out_dir and Path(a.out_dir))}")


if __name__ == "__main__":
    main()
