"""A rollout worker for transport tests: the real ``RolloutWorker`` with the tiny HF engine.

Started as its own process tree (like the rollout Slurm job step). ``--stall-at k --stall-s s``
makes the k-th engine call sleep (a stalled worker; ``stalling<W>.json`` says when it began), ``--die-at-load k`` kills it in the middle
of a weight sync; ``--chunk-tokens``, ``--max-inflight`` and ``--update-mode`` are the worker's
streaming knobs (``RolloutWorkerConfig``); at exit the engine's state dict and version
are saved under ``--out`` so a test can compare them bitwise with the trainer's export.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

from megatron_darl.rollout.config import EngineConfig, SamplingConfig
from megatron_darl.rollout.config import RolloutWorkerConfig
from megatron_darl.rollout.engines import build_engine
from megatron_darl.rollout.prompts import PromptRecord, PromptSource
from megatron_darl.rollout.worker import RolloutWorker
from megatron_darl.transport import (
    ChannelConfig, ControlPlaneConfig, HeartbeatConfig, StalenessBound, Topology, TransportConfig, WeightSyncConfig,
)


class FaultyEngine:
    """Delegates to an engine; its ``stall_at``-th generate call first sleeps ``stall_s`` and its
    ``die_at_load``-th ``load_weights`` call (one per bucket) kills the process mid-sync."""

    def __init__(self, engine, stall_at: int, stall_s: float, die_at_load: int, out: str, worker: int) -> None:
        self.engine, self.stall_at, self.stall_s, self.calls = engine, stall_at, stall_s, 0
        self.die_at_load, self.loads = die_at_load, 0
        self.out, self.worker = out, worker

    def generate(self, prompts, sampling):
        self.calls += 1
        if self.calls == self.stall_at:
            start = time.time()
            with open(os.path.join(self.out, f"stalling{self.worker}.json"), "w") as f:
                json.dump({"start": start}, f)  # the batch's starts are reserved: in flight now
            time.sleep(self.stall_s)
            with open(os.path.join(self.out, f"stall{self.worker}.json"), "w") as f:
                json.dump({"start": start, "end": time.time()}, f)
        return self.engine.generate(prompts, sampling)

    def load_weights(self, named):
        self.loads += 1
        if self.loads == self.die_at_load:
            os._exit(9)  # a crash in the middle of a weight sync
        self.engine.load_weights(named)

    def close(self):
        self.engine.close()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name, typ, default in [
        ("port", int, 0), ("worker", int, 0), ("workers", int, 1), ("hubs", int, 1), ("stages", int, 1),
        ("gps", int, 1), ("eta", int, 0), ("batch", int, 4), ("n", int, 2), ("max-new", int, 4),
        ("hb-interval", float, 0.25), ("hb-timeout", float, 4.0), ("join-timeout", float, 2.0),
        ("timeout", float, 60.0), ("stall-at", int, 0), ("stall-s", float, 0.0), ("out", str, ""),
        ("model-dir", str, ""), ("die-at-load", int, 0), ("chunk-tokens", int, 0), ("max-inflight", int, 0),
        ("update-mode", str, "finish"), ("secret", str, ""), ("channel", str, "dataplane"),
    ]:
        p.add_argument(f"--{name}", type=typ, default=default)
    return p.parse_args()


def main() -> int:
    a = parse()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rollout {a.worker}] %(message)s")
    torch.set_num_threads(1)
    transport = TransportConfig(
        control=ControlPlaneConfig(host="127.0.0.1", port=a.port, store_timeout_s=a.timeout, poll_interval_s=0.005,
                                   secret=a.secret),
        heartbeat=HeartbeatConfig(a.hb_interval, a.hb_timeout),
        channel=ChannelConfig(max_unacked_per_hub=4,
                              send_timeout_s=a.timeout, transport=a.channel),
        weight_sync=WeightSyncConfig(backend="gloo", join_timeout_s=a.join_timeout,
                                     collective_timeout_s=a.timeout, ack_timeout_s=a.timeout),
    )
    engine = build_engine(EngineConfig(backend="hf", model_path=a.model_dir, device="cpu", max_batch_size=64))
    if a.stall_at or a.die_at_load:
        engine = FaultyEngine(engine, a.stall_at, a.stall_s, a.die_at_load, a.out, a.worker)
    records = [PromptRecord(prompt_id=i, token_ids=(1 + i % 200, 2, 3), record=i) for i in range(64)]
    worker = RolloutWorker(
        RolloutWorkerConfig(worker_id=a.worker, groups_per_batch=a.batch, reward_threads=2,
                            chunk_tokens=a.chunk_tokens, max_inflight=a.max_inflight, update_mode=a.update_mode),
        transport, StalenessBound(max_staleness=a.eta, groups_per_step=a.gps),
        Topology(workers=a.workers, hubs=a.hubs, stages=a.stages), engine, PromptSource(records, a.worker, a.workers, seed=0),
        SamplingConfig(n=a.n, max_new_tokens=a.max_new, temperature=1.0, seed=a.worker),
        reward_fn=lambda record, text: float(len(text) % 3), decode=lambda ids: " ".join(map(str, ids)),
    )
    code = worker.run()
    inner = engine.engine if isinstance(engine, FaultyEngine) else engine
    torch.save({"version": worker.weights_version, "state": {k: v.clone() for k, v in inner.state_dict().items()}},
               os.path.join(a.out, f"worker{a.worker}.pt"))
    return code


if __name__ == "__main__":
    sys.exit(main())
