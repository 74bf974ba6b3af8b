"""Benchmark ``channel``: MB/s and groups/s through the sample channel, and the control plane meanwhile.

``--workers`` rollout-worker processes send ``--groups`` framed groups in all (G samples x T
tokens each) to ``--hubs`` hub processes (each group to ``shard_of(group_id, hubs, workers)``),
through the real ``SampleSender``/``SampleHub``. ``--transport dataplane`` carries each payload
over a worker<->hub pair group (gloo on CPU; NCCL between distinct GPUs with ``--devices auto`` on
a GPU host: hub h on GPU h, worker w on GPU (hubs + w) mod GPUs) while the store carries the small
headers and acks; ``--transport store`` puts the payloads in the control-plane TCPStore itself
(the small-payload path). This process only serves the store, as trainer rank 0 does.

A probe process reads a control key in a loop, as heartbeats and control flags do, and reports
its round-trip latency before the groups flow (idle) and while they flow: payloads in the store
share one server with every control key. Each worker first sends one warm-up group to every hub
(the data plane builds its pairs then); throughput counts from the moment every process is ready
and told to go to the last group's arrival.

    python benchmarks/channel.py --transport dataplane --workers 4 --hubs 2
    python benchmarks/channel.py --transport store --workers 16 --hubs 1 --group-size 8 --tokens 2048
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402
from benchmarks.stack_sampler import StackSampler  # noqa: E402
from megatron_darl.ports import free_port  # noqa: E402
from megatron_darl.samples import Sample, SampleGroup, shard_of  # noqa: E402
from megatron_darl.transport import (  # noqa: E402
    ChannelConfig, ControlPlaneConfig, SampleHub, SampleSender, StartTicket, connect_store, frame_group,
    Topology, serve_store,
)
from megatron_darl.transport.frames import GroupMeta  # noqa: E402

PROBE_KEY = "bench/probe"
WARM = 1 << 40  # warm-up group ids start here (one per worker and hub, not timed)


def template(g: int, t: int, prompt: int) -> list[Sample]:
    return [Sample(sample_id=i, prompt_ids=torch.randint(0, 150000, (prompt,)),
                   response_ids=torch.randint(0, 150000, (t,)), behavior_logprobs=-torch.rand(t),
                   token_versions=torch.full((t,), 3)) for i in range(g)]


def _device(a, role: str, index: int) -> torch.device:
    if a.devices == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    n = torch.cuda.device_count()
    return torch.device("cuda", index % n if role == "hub" else (a.hubs + index) % n)


def _control(a, port: int) -> ControlPlaneConfig:
    return ControlPlaneConfig(port=port, poll_interval_s=0.0005, store_timeout_s=120)


def _topology(a) -> Topology:
    return Topology(workers=a.workers, hubs=a.hubs)


def _channel(a) -> ChannelConfig:
    return ChannelConfig(transport=a.transport, max_unacked_per_hub=a.max_unacked)


def my_groups(a, worker: int) -> list[int]:
    """Group ids of one worker: ids w, w + N, ... (worker folded in), ``--groups`` in all."""
    return list(range(worker, a.groups, a.workers))


def warm_ids(a, w: int) -> list[int]:
    """One warm-up group id per hub for worker ``w`` (ids fold the worker in like real ones)."""
    out, local = [], 0
    while len(out) < a.hubs:
        gid = WARM + local * a.workers + w
        if shard_of(gid, a.hubs, a.workers) not in [shard_of(x, a.hubs, a.workers) for x in out]:
            out.append(gid)
        local += 1
    return out


def threads_per_process(a) -> int:
    """Torch threads per process as the launcher sets them (cores / processes): unbounded, every
    process of a many-core host spins a full pool on each framing ``cat``."""
    return a.threads or max(1, (os.cpu_count() or 1) // (a.workers + a.hubs + 1))


def _threads(a) -> None:
    torch.set_num_threads(threads_per_process(a))
    if a.switch_interval_ms > 0:  # how long a CPU-bound thread may hold the GIL (default 5 ms)
        sys.setswitchinterval(a.switch_interval_ms / 1000)


def worker(a, port: int, w: int, results, go) -> None:
    _threads(a)
    dev = _device(a, "worker", w)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    control = _control(a, port)
    sender = SampleSender(connect_store(control, who=f"rollout {w}"), control, _channel(a), _topology(a), w,
                          device=dev)
    samples = template(a.group_size, a.tokens, a.prompt_tokens)
    for gid in warm_ids(a, w):
        sender.send(SampleGroup(group_id=gid, prompt_id=gid, samples=samples, worker_id=w), StartTicket(0, 1))
    sender.flush(600)
    results.put(("ready", f"worker {w}"))
    go.wait(600)
    sampler = StackSampler().start() if a.sample_stacks else None
    for gid in my_groups(a, w):
        sender.send(SampleGroup(group_id=gid, prompt_id=gid, samples=samples, worker_id=w), StartTicket(0, gid + 1))
    sender.flush(600)
    if sampler is not None:
        print(f"--- stacks of worker {w}\n{sampler.stop().report()}", flush=True)
    sender.close()


def hub(a, port: int, h: int, results) -> None:
    _threads(a)
    dev = _device(a, "hub", h)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    control = _control(a, port)
    hub_ = SampleHub(connect_store(control, who=f"trainer {h}"), control, _channel(a), _topology(a), h,
                      device=dev)
    expect = sum(shard_of(gid, a.hubs, a.workers) == h for w in range(a.workers) for gid in my_groups(a, w))
    got, first, last, deadline = 0, None, None, time.monotonic() + 600
    sampler = StackSampler().start() if a.sample_stacks else None
    while got < expect and time.monotonic() < deadline:
        n = sum(r.group.group_id < WARM for r in hub_.poll())
        if n:
            last = time.time()
            first = first or last
            got += n
        else:
            time.sleep(0.0005)
    if sampler is not None:
        print(f"--- stacks of hub {h}\n{sampler.stop().report()}", flush=True)
    results.put(("hub", h, got, expect, first, last, hub_.transfers_received))
    hub_.close()


def probe(port: int, results, stop) -> None:
    store = connect_store(ControlPlaneConfig(port=port, store_timeout_s=120), who="probe")
    store.set(PROBE_KEY, "1")
    results.put(("ready", "probe"))
    samples = []
    while not stop.is_set():
        t0 = time.perf_counter()
        store.read(PROBE_KEY)
        samples.append((time.time(), time.perf_counter() - t0))
        time.sleep(0.005)
    results.put(("probe", samples))


def _ms(values: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(values, n=100)[q - 1] if len(values) > 2 else float("nan")


def run(a) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    store = serve_store(_control(a, port))  # noqa: F841 (serves the run until the end)
    results, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=hub, args=(a, port, h, results)) for h in range(a.hubs)]
    procs += [ctx.Process(target=worker, args=(a, port, w, results, go)) for w in range(a.workers)]
    prober = ctx.Process(target=probe, args=(port, results, stop))
    for p in [prober, *procs]:
        p.start()
    try:
        ready = [results.get(timeout=900) for _ in range(a.workers + 1)]  # workers warmed up, probe on
        assert all(r[0] == "ready" for r in ready), ready
        time.sleep(a.idle_s)  # every process is up and idle: the probe measures the quiet store
        t_go = time.time()
        go.set()
        hubs = [results.get(timeout=900) for _ in range(a.hubs)]
        stop.set()
        samples = results.get(timeout=60)[1]
    finally:  # a failure above leaves no process behind (the probe would loop, and exit would join it)
        stop.set()
        go.set()
        for p in [prober, *procs]:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert all(got == expect for _, _, got, expect, *_ in hubs), hubs
    first, last = t_go, max(x[5] for x in hubs)
    group_bytes = int(frame_group(SampleGroup(0, 0, template(a.group_size, a.tokens, a.prompt_tokens), 0),
                                  GroupMeta(0, 0, 1)).to_buffer().numel())
    seconds = last - first
    idle = [lat for t, lat in samples if t < t_go]
    busy = [lat for t, lat in samples if first <= t <= last]
    return {"mb_per_s": a.groups * group_bytes / seconds / 1e6, "groups_per_s": a.groups / seconds,
            "group_bytes": group_bytes, "seconds": seconds,
            # each worker's warm-up group to each hub crossed alone (flushed before the run)
            "groups_per_transfer": a.groups / max(1, sum(x[6] for x in hubs) - a.workers * a.hubs),
            "control_ms_p50_idle": _ms(idle, 50), "control_ms_p99_idle": _ms(idle, 99),
            "control_ms_p50_flowing": _ms(busy, 50), "control_ms_p99_flowing": _ms(busy, 99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=("dataplane", "store"), default="dataplane")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--hubs", type=int, default=1)
    p.add_argument("--groups", type=int, default=128, help="groups in all (over the workers)")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096, help="response tokens per sample")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-unacked", type=int, default=8)
    p.add_argument("--devices", choices=("auto", "cpu"), default="auto", help="auto: GPUs when there are")
    p.add_argument("--idle-s", type=float, default=3.0, help="quiet time before the groups flow")
    p.add_argument("--tiny", action="store_true", help="CPU smoke check: 16 groups of 4 x 256 tokens")
    p.add_argument("--sample-stacks", action="store_true",
                   help="print where each thread of each worker and hub spent the run (benchmarks/stack_sampler.py)")
    p.add_argument("--switch-interval-ms", type=float, default=0.0,
                   help="sys.setswitchinterval in hubs and workers (0: Python's default, 5 ms)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores / processes)")
    p.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    a = p.parse_args()
    if a.tiny:
        a.groups, a.group_size, a.tokens, a.prompt_tokens = 16, 4, 256, 64
    metrics = run(a)
    config = {"transport": a.transport, "workers": a.workers, "hubs": a.hubs, "groups": a.groups,
              "group_size": a.group_size, "tokens": a.tokens, "prompt_tokens": a.prompt_tokens,
              "max_unacked": a.max_unacked, "devices": a.devices,
              "threads": threads_per_process(a), "switch_interval_ms": a.switch_interval_ms or 5.0}
    print_table([{**config, **metrics}])
    print(write_result("channel", config, metrics, a.out_dir))


if __name__ == "__main__":
    main()
