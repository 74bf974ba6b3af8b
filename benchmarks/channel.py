"""Benchmark ``channel``: sample groups per second and MB/s through the sample channel.

A rollout worker process posts framed groups (G samples x T tokens) through the control-plane
TCPStore; the trainer hub (this process, which serves the store) takes them, deduplicates and
acks. This is the measurement behind the channel's choice of the store over a data-plane
collective (see ``megatron_darl/transport/channel.py``).

    python benchmarks/channel.py                 # G=16, T=4096, 200 groups
    python benchmarks/channel.py --tiny          # CPU smoke check
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402
from megatron_darl.samples import Sample, SampleGroup  # noqa: E402
from megatron_darl.transport import (  # noqa: E402
    ChannelConfig, ControlPlaneConfig, SampleHub, SampleSender, StartTicket, connect_store, frame_group,
    serve_store,
)
from megatron_darl.transport.frames import GroupMeta  # noqa: E402


def make_group(gid: int, g: int, t: int, prompt: int) -> SampleGroup:
    samples = [Sample(sample_id=gid * g + i, prompt_ids=torch.randint(0, 150000, (prompt,)),
                      response_ids=torch.randint(0, 150000, (t,)), behavior_logprobs=-torch.rand(t),
                      token_versions=torch.full((t,), 3)) for i in range(g)]
    return SampleGroup(group_id=gid, prompt_id=gid, samples=samples, worker_id=0)


def _worker(port: int, groups: int, g: int, t: int, prompt: int, unacked: int) -> None:
    control = ControlPlaneConfig(port=port, poll_interval_s=0.0005)
    sender = SampleSender(connect_store(control), control, ChannelConfig(max_unacked_per_hub=unacked), 0)
    for gid in range(groups):
        sender.send(make_group(gid, g, t, prompt), StartTicket(0, gid + 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=200)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=4096, help="response tokens per sample")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-unacked", type=int, default=8)
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    if a.tiny:
        a.groups, a.group_size, a.tokens, a.prompt_tokens = 50, 4, 256, 64
    from megatron_darl.ports import free_port

    port = free_port()
    control = ControlPlaneConfig(port=port, poll_interval_s=0.0005)
    store = serve_store(control)
    hub = SampleHub(store, control, 0)
    group_bytes = len(frame_group(make_group(0, a.group_size, a.tokens, a.prompt_tokens), GroupMeta(0, 0, 1)).to_bytes())
    proc = mp.get_context("spawn").Process(
        target=_worker, args=(port, a.groups, a.group_size, a.tokens, a.prompt_tokens, a.max_unacked))
    proc.start()
    first = hub.receive(1, timeout_s=300)  # start the clock at the first arrival (process start-up excluded)
    t0 = time.perf_counter()
    rest = hub.receive(a.groups - 1, timeout_s=600)
    seconds = time.perf_counter() - t0
    proc.join(60)
    assert len(first) + len(rest) == a.groups and hub.duplicates_dropped == 0
    n = a.groups - 1
    metrics = {"groups_per_s": n / seconds, "mb_per_s": n * group_bytes / seconds / 1e6,
               "group_bytes": group_bytes, "seconds": seconds}
    config = {"groups": a.groups, "group_size": a.group_size, "tokens": a.tokens,
              "prompt_tokens": a.prompt_tokens, "max_unacked": a.max_unacked, "transport": "tcpstore"}
    print_table([{**config, **metrics}])
    print(write_result("channel", config, metrics))


if __name__ == "__main__":
    main()
