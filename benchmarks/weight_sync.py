"""Benchmark ``weight_sync``: trainer export + bucketed broadcast + in-place load + ack, end to end.

Trainer (stage-0 leader, serves the store) on GPU0, ``--workers`` rollout workers (``hf`` engine)
on GPUs 1..N, processes meeting only through the transport, as in production. ``seconds`` is one
``WeightSender.publish`` (export of HF-named tensors, broadcast, load, ack, published version
moved); ``bound_seconds`` is one NCCL broadcast of the same bytes as a single buffer over the same
processes in the same run; ``ratio_to_bound`` = seconds / bound_seconds (target <= 2).

    python benchmarks/weight_sync.py --model 4b                # 2 GPUs
    python benchmarks/weight_sync.py --model 4b --workers 4    # 5 GPUs
    python benchmarks/weight_sync.py --model 4b --colocated ipc   # 1 GPU shared (CUDA IPC)
    python benchmarks/weight_sync.py --model 4b --colocated gloo  # 1 GPU shared, host fallback
    python benchmarks/weight_sync.py --tiny --workers 2        # CPU smoke check (gloo)

Colocated (trainer and worker on GPU 0, ``config.path`` ``colocated`` or ``colocated_gloo``):
``bound_seconds`` is one device-to-device copy of the same bytes on that GPU, the least any
path must do (the worker's copy into its parameters).

A TP/PP trainer exports through its stage leaders (``trainer.export_hf_stage``); the whole path
at TP2/TP4 is timed by the loop itself (``weight_sync_seconds`` in metrics.jsonl), e.g.
``benchmarks/async_speedup.py --splits 4:4 parallel.tp=4``, against this script's bound.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402

SHAPES = {  # Qwen3 dense shapes (tied embeddings up to 4B)
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    """Randomly initialised Qwen3 of the named shape (HF naming)."""
    import transformers

    cfg = transformers.Qwen3Config(**SHAPES[name], rope_parameters={"rope_theta": 1e6}, tie_word_embeddings=True)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def export(model) -> list[tuple[str, torch.Tensor]]:
    """HF-named full tensors, each storage once (a tied ``lm_head.weight`` is not sent twice)."""
    seen, out = set(), []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out.append((name, tensor))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="4b", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU with gloo (smoke check)")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, default=1, help="rollout workers, one GPU each")
    p.add_argument("--colocated", choices=["ipc", "gloo"], default=None,
                   help="one worker on the trainer's GPU 0: CUDA IPC handles or gloo through host memory")
    p.add_argument("--index", type=int, default=0, help="(worker role) this worker's index")
    p.add_argument("--role", default="main", choices=["main", "trainer", "worker"])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    a = p.parse_args()
    if a.tiny:
        a.model = "tiny"
    return a


def _transport(a: argparse.Namespace):
    from megatron_darl.transport import ControlPlaneConfig, HeartbeatConfig, WeightSyncConfig

    control = ControlPlaneConfig(host="127.0.0.1", port=a.port, store_timeout_s=600, poll_interval_s=0.0005)
    backend = "gloo" if a.tiny else ("auto" if a.colocated else "nccl")
    sync = WeightSyncConfig(backend=backend, colocated=a.colocated or "ipc", bucket_bytes=a.bucket_mb << 20,
                            join_timeout_s=600, collective_timeout_s=600, ack_timeout_s=600)
    return control, HeartbeatConfig(interval_s=0.5, timeout_s=60), sync


def _bound(store, rank: int, world: int, nbytes: int, backend: str, device: torch.device,
           repeats: int) -> float:
    """Best time of one broadcast of ``nbytes`` as one buffer from the trainer to every worker."""
    from megatron_darl.transport import build_group

    group = build_group(store, "bound", rank, world, backend, 600)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    tick = torch.zeros(1, device=device)
    best = float("inf")
    for i in range(repeats + 2):
        group.broadcast(tick, 0, "bound tick")  # line both sides up
        _sync(device)
        t0 = time.perf_counter()
        group.broadcast(buf, 0, "bound buffer")
        _sync(device)
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return best


def _copy_bound(nbytes: int, device: torch.device, repeats: int) -> float:
    """Best time of one device-to-device copy of ``nbytes`` (the colocated floor)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return best


def trainer(a: argparse.Namespace) -> None:
    from megatron_darl.transport import (
        TRAINER, WORKER, Heartbeat, MemberInfo, Topology, WeightSender, register, serve_store,
    )

    device = torch.device("cpu") if a.tiny else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    control, hb_cfg, sync = _transport(a)
    store = serve_store(control)
    me = MemberInfo.here(TRAINER, 0)
    register(store, me)
    hb = Heartbeat(control, hb_cfg, me).start()
    model = build_model(a.model, device, torch.float32 if a.tiny else torch.bfloat16)
    sender = WeightSender(store, control, sync, Topology(workers=a.workers), 0, hb, device=device)
    deadline = time.monotonic() + 600
    while not all(hb.is_alive(WORKER, w) for w in range(a.workers)):  # every worker beats first
        assert time.monotonic() < deadline, "benchmark workers did not start"
        hb.refresh(store)
        time.sleep(0.05)
    times, nbytes = [], 0
    for version in range(1, a.repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        report = sender.publish(version, export(model))  # the trainer's export
        _sync(device)
        if version > 1:  # the first sync also builds the communicator
            times.append(time.perf_counter() - t0)
        nbytes = report.bytes
        assert report.published and sorted(report.acked) == list(range(a.workers)), report
    if a.colocated:
        bound = _copy_bound(nbytes, device, a.repeats)
    else:
        bound = _bound(store, 0, a.workers + 1, nbytes, sync.backend, device, a.repeats)
    seconds = min(times)
    metrics = {"seconds": seconds, "seconds_mean": sum(times) / len(times), "bound_seconds": bound,
               "ratio_to_bound": seconds / bound, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9}
    config = {"model": a.model, "bucket_mb": a.bucket_mb, "repeats": a.repeats, "backend": sync.backend,
              "dtype": "fp32" if a.tiny else "bf16"}
    if a.workers > 1:  # records of one worker keep their earlier config (and table row)
        config["workers"] = a.workers
    if a.colocated:
        config["path"] = "colocated" if a.colocated == "ipc" else "colocated_gloo"
        config["backend"] = "cuda_ipc" if a.colocated == "ipc" else "gloo"
    print_table([{**config, **metrics}])
    print(write_result("weight_sync", config, metrics, a.out_dir))
    store.set("bench/done", "1")
    hb.close()


def worker(a: argparse.Namespace) -> None:
    from megatron_darl.rollout.config import EngineConfig
    from megatron_darl.rollout.engines.hf import HFEngine
    from megatron_darl.transport import (
        WORKER, Heartbeat, MemberInfo, Topology, WeightReceiver, connect_store, register,
    )

    device = torch.device("cpu") if a.tiny else torch.device("cuda", 0 if a.colocated else 1 + a.index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    control, hb_cfg, sync = _transport(a)
    store = connect_store(control, who="benchmark worker")
    me = MemberInfo.here(WORKER, a.index)
    register(store, me)
    hb = Heartbeat(control, hb_cfg, me).start()
    model = build_model(a.model, device, torch.float32 if a.tiny else torch.bfloat16)
    engine = HFEngine(EngineConfig(device=str(device), dtype="fp32" if a.tiny else "bf16"), model=model)
    receiver = WeightReceiver(store, control, sync, Topology(workers=a.workers), a.index, engine.load_weights,
                              initial_version=0)
    while receiver.version < a.repeats + 1:
        receiver.maybe_sync()
        time.sleep(0.0005)
    nbytes = sum(t.numel() * t.element_size() for _, t in export(model))
    if not a.colocated:
        _bound(store, 1 + a.index, a.workers + 1, nbytes, sync.backend, device, a.repeats)
    store.wait(["bench/done"], 3600.0, "the benchmark trainer to finish")
    hb.close()


def main() -> None:
    a = _parse()
    if a.role == "trainer":
        return trainer(a)
    if a.role == "worker":
        return worker(a)
    if a.colocated and (a.workers != 1 or a.tiny or not torch.cuda.is_available()):
        sys.exit("weight_sync --colocated: one worker on GPU 0 beside the trainer (needs a GPU)")
    if not a.tiny and not a.colocated and torch.cuda.device_count() < 1 + a.workers:
        sys.exit(f"weight_sync --workers {a.workers} needs {1 + a.workers} GPUs (trainer on GPU0, "
                 f"workers on the next); {torch.cuda.device_count()} visible; use --tiny on CPU")
    from megatron_darl.ports import free_port

    port = free_port()
    args = [sys.executable, __file__, "--model", a.model, "--bucket-mb", str(a.bucket_mb),
            "--repeats", str(a.repeats), "--port", str(port), "--workers", str(a.workers)]
    args += ["--out-dir", str(a.out_dir)] if a.out_dir else []
    args += ["--tiny"] if a.tiny else []
    args += ["--colocated", a.colocated] if a.colocated else []
    procs = [subprocess.Popen(args + ["--role", "trainer"])]
    procs += [subprocess.Popen(args + ["--role", "worker", "--index", str(i)]) for i in range(a.workers)]
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        sys.exit(f"weight_sync benchmark failed: exit codes {codes}")


if __name__ == "__main__":
    main()
