"""Benchmark ``checkpoint_io``: how long one trainer rank takes to write and seal a checkpoint.

Why: ``scancel`` gives a job Slurm's ``KillWait`` (30 s by default) between SIGTERM and SIGKILL,
and in that window the trainer finishes its step, writes the checkpoint and seals it with a
checksum manifest. At 1.7B one rank's checkpoint is 24 GB (bf16 weights, fp32 main weights,
Adam moments) plus 3.4 GB per parameter snapshot D-ARL keeps. This measures the two parts on the
machine it runs on, with a synthetic state of that size in 256 MiB tensors:

- the write: ``dist_checkpointing.save`` (torch_dist) at each ``--writer-threads`` count (files
  written in parallel by one rank);
- the seal: the manifest's digests, format 1 (one SHA-256 stream per file) against format 2
  (SHA-256 of 64 MiB blocks on a pool of threads, ``megatron_darl/checkpoint/checksums.py``),
  read back right after the write as the save does.

    python benchmarks/checkpoint_io.py --gib 4 --writer-threads 2,8
    python benchmarks/checkpoint_io.py --gib 24 --dir /local/nvme/tmp     # a 1.7B rank's share
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402
from megatron_darl.checkpoint import checksums  # noqa: E402

TENSOR_BYTES = 256 << 20


def synthetic_state(gib: float) -> dict:
    """``gib`` GiB of float32 ShardedTensors (one rank holds them whole), random so no
    filesystem compresses them."""
    from megatron.core.dist_checkpointing import ShardedTensor

    count = max(1, round(gib * (1 << 30) / TENSOR_BYTES))
    gen = torch.Generator().manual_seed(0)
    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.rand(TENSOR_BYTES // 4, generator=gen))
            for i in range(count)}


def write(state: dict, folder: Path, threads: int) -> float:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_darl.checkpoint.model_io import use_local_results_queue

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    use_local_results_queue()
    start = time.perf_counter()
    dist_checkpointing.save(state, str(folder), sharded_strategy=TorchDistSaveShardedStrategy(
        "torch_dist", 1, thread_count=threads))
    os.sync()
    return time.perf_counter() - start


def seal(folder: Path, block_bytes: int) -> float:
    files = {name: (folder / name).stat().st_size for name in checksums.checkpoint_files(folder)}
    start = time.perf_counter()
    checksums.file_digests(folder, {name: (size, block_bytes) for name, size in files.items()})
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="the rank's checkpoint size")
    p.add_argument("--writer-threads", default="2,8", help="torch_dist writer thread counts to time")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--out-dir", type=Path, default=None)
    a = p.parse_args(argv)
    threads = [int(t) for t in a.writer_threads.split(",")]
    if not torch.cuda.is_available():  # megatron-core's writer synchronizes CUDA
        from megatron_darl.trainer.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    state = synthetic_state(a.gib)
    nbytes = sum(t.data.numel() * t.data.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="darl_ckpt_io_", dir=a.dir))
    rows, metrics = [], {"bytes": nbytes, "hash_threads": checksums.hash_threads()}
    try:
        for t in threads:
            seconds = write(state, root / f"w{t}", t)
            metrics[f"write_seconds_threads{t}"] = seconds
            rows.append({"phase": f"write, {t} writer threads", "seconds": seconds, "GB/s": nbytes / seconds / 1e9})
            if t != threads[-1]:
                shutil.rmtree(root / f"w{t}")
        last = root / f"w{threads[-1]}"
        for name, block in (("seal, format 1 (one SHA-256 per file, files in parallel)", 0),
                            (f"seal, format 2 ({checksums.hash_threads()} threads)", checksums.BLOCK_BYTES)):
            seconds = seal(last, block)
            metrics[f"seal_seconds_format{1 if not block else 2}"] = seconds
            rows.append({"phase": name, "seconds": seconds, "GB/s": nbytes / seconds / 1e9})
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    print(f"{nbytes / 1e9:.1f} GB on one rank, in {a.dir or tempfile.gettempdir()}")
    print_table(rows)
    write_result("checkpoint_io", {"gib": a.gib, "writer_threads": threads, "dir": str(a.dir or "tmp")},
                 metrics, out_dir=a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
