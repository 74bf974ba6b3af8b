"""A Megatron TP x PP trainer job step that publishes its HF export to rollout workers (gloo).

Started as one process tree (like ``srun --ntasks=tp*pp`` for the trainer): this supervisor
imports Megatron once, forks one process per rank and waits for them; if a rank fails or the
``--deadline`` passes it kills the others and exits non-zero, so no rank outlives the step.

Each rank runs the production pieces in order: ``init_parallel`` (gloo), the loop's
``open_endpoints`` (rank 0 serves the control-plane store; TP-0 rank of each PP stage owns a
``WeightSender``), a ``PolicyTrainer`` loaded from ``--model-dir`` that takes ``--train-steps``
Adam steps (so the export differs from the checkpoint), then ``export_hf_stage`` streamed into
``WeightSender.publish`` as version ``trainer.version``. The TP-1 ranks iterate the same export
for its gathers. Every stage leader saves exactly what it streamed (``export{stage}.pt``) and its
``SyncReport`` (``sync{stage}.json``); the coordinator adds the store's published version and
acks. Rank 0 then asks the workers to stop and waits for their exits before the store goes away.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import logging
import multiprocessing
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

# Imported before forking so that the ranks share them instead of importing them four times.
from megatron_darl.loop.endpoints import open_endpoints, wait_for_workers
from megatron_darl.models.qwen3 import build_qwen3_model, load_hf_checkpoint
from megatron_darl.trainer.config import MicroBatchConfig, OptimizerConfig, TrainerConfig
from megatron_darl.trainer.config import ParallelConfig
from megatron_darl.trainer.parallel import destroy_parallel, init_parallel
from megatron_darl.trainer.policy_trainer import PolicyTrainer
from megatron_darl.transport import (
    WORKER, ChannelConfig, ControlPlaneConfig, HeartbeatConfig, StalenessBound, Topology, TransportConfig,
    WeightSyncConfig,
    published_version, request_stop, wait_for_exits,
)
from megatron_darl.transport.store import get_int
from megatron_darl.transport.weight_sync import SyncKeys
from tests.distributed.procs.trainer_procs import make_batch, toy_loss

log = logging.getLogger("megatron_sender")
# Megatron modules the ranks import lazily (model, DDP, optimizer, schedule): loaded once, pre-fork.
PRELOAD = ["megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
           "megatron.core.optimizer_param_scheduler", "megatron.core.pipeline_parallel"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name, typ, default in [
        ("port", int, 0), ("dist-port", int, 0), ("tp", int, 2), ("pp", int, 2), ("workers", int, 2),
        ("train-steps", int, 1), ("bucket-bytes", int, 64 * 1024), ("hb-interval", float, 0.25),
        ("hb-timeout", float, 20.0), ("join-timeout", float, 30.0), ("timeout", float, 60.0),
        ("deadline", float, 150.0), ("out", str, ""), ("model-dir", str, ""),
    ]:
        p.add_argument(f"--{name}", type=typ, default=default)
    return p.parse_args(argv)


def transport_config(a: argparse.Namespace) -> TransportConfig:
    """The same transport the workers are started with (one hub: DP 1)."""
    return TransportConfig(
        control=ControlPlaneConfig(host="127.0.0.1", port=a.port, store_timeout_s=a.timeout, poll_interval_s=0.005),
        heartbeat=HeartbeatConfig(a.hb_interval, a.hb_timeout),
        channel=ChannelConfig(send_timeout_s=a.timeout),
        weight_sync=WeightSyncConfig(backend="gloo", bucket_bytes=a.bucket_bytes, join_timeout_s=a.join_timeout,
                                     collective_timeout_s=a.timeout, ack_timeout_s=a.timeout),
    )


def build_trainer(a: argparse.Namespace, ps) -> PolicyTrainer:
    """A fp32 ``PolicyTrainer`` holding the HF checkpoint in ``--model-dir``."""
    with open(os.path.join(a.model_dir, "config.json")) as f:
        hf_config = json.load(f)
    chunks = build_qwen3_model(hf_config, ps, calculate_per_token_loss=True)
    load_hf_checkpoint(chunks, a.model_dir, ps)
    cfg = TrainerConfig(
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0, adam_eps=1e-6),
        micro_batch=MicroBatchConfig(token_budget=512, max_seq_len=64, pad_multiple=8),
        bf16=False,
    )
    return PolicyTrainer(cfg, ps, hf_config, model_chunks=chunks)


def publish(a: argparse.Namespace, ep, trainer: PolicyTrainer, ps) -> None:
    """Stream this stage's export into the sender (leaders) or through the TP gathers (others)."""
    named = trainer.export_hf_stage()
    if ep.sender is None:
        for _ in named:
            pass
        return
    sent: dict[str, torch.Tensor] = {}

    def recorded():
        for name, tensor in named:
            sent[name] = tensor.detach().clone()  # norms are views of live params
            yield name, tensor

    report = ep.sender.publish(trainer.version, recorded())
    for _ in named:  # the sender stops early when no worker is ready: finish the TP gathers anyway
        pass
    torch.save(sent, os.path.join(a.out, f"export{ps.pp_rank}.pt"))
    record = dict(report.__dict__)
    if ps.pp_rank == 0:  # the coordinator: what the store says now
        record["store_published"] = published_version(ep.store)
        record["store_acks"] = [get_int(ep.store, SyncKeys.ack(w), -1) for w in range(a.workers)]
    with open(os.path.join(a.out, f"sync{ps.pp_rank}.json"), "w") as f:
        json.dump(record, f)


def run_rank(rank: int, a: argparse.Namespace) -> None:
    """One trainer rank: parallel state, endpoints, a train step, publish, shut down."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [trainer {rank}] %(message)s", force=True)
    torch.set_num_threads(1)
    ps = init_parallel(ParallelConfig(tp=a.tp, pp=a.pp, backend="gloo", timeout_s=a.timeout), rank=rank,
                       world_size=a.tp * a.pp, init_method=f"tcp://127.0.0.1:{a.dist_port}")
    ep = open_endpoints(transport_config(a), StalenessBound(max_staleness=0, groups_per_step=1),  # early: the
                        Topology(workers=a.workers, hubs=1, stages=a.pp), ps)  # workers connect meanwhile
    log.info("parallel state and endpoints up (tp %d, pp %d)", ps.tp_rank, ps.pp_rank)
    try:
        trainer = build_trainer(a, ps)
        log.info("trainer built, checkpoint loaded")
        for _ in range(a.train_steps):
            result = trainer.train_step(make_batch(), toy_loss)
            log.info("step %d: loss %.4f grad norm %.4f", trainer.optimizer_steps, result.loss, result.grad_norm)
        wait_for_workers(ep, ps, a.workers, a.timeout / 2)  # within the other ranks' barrier timeout
        log.info("workers up; publishing v%d", trainer.version)
        publish(a, ep, trainer, ps)
        log.info("published")
        if ps.rank == 0:
            request_stop(ep.store)
            left = wait_for_exits(ep.store, WORKER, list(range(a.workers)), a.timeout)
            if left:
                raise TimeoutError(f"rollout workers {left} did not exit within {a.timeout:.0f} s of the stop flag")
        dist.monitored_barrier(timeout=dt.timedelta(seconds=2 * a.timeout))  # the store outlives every use
    finally:
        ep.close()
    destroy_parallel()


def supervise(a: argparse.Namespace) -> int:
    """Fork the ranks and wait; the first failure or the deadline kills the rest."""
    for module in PRELOAD:
        importlib.import_module(module)
    assert threading.active_count() == 1, f"threads before fork: {threading.enumerate()}"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=run_rank, args=(r, a), name=f"rank{r}") for r in range(a.tp * a.pp)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + a.deadline
    code = 0
    while any(proc.is_alive() for proc in procs):
        failed = [proc for proc in procs if proc.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            code = failed[0].exitcode if failed else 124
            why = f"{failed[0].name} exited {code}" if failed else f"deadline {a.deadline:.0f} s passed"
            print(f"megatron_sender: {why}; killing the other ranks", file=sys.stderr, flush=True)
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            break
        time.sleep(0.1)
    for proc in procs:
        proc.join(timeout=10)
    codes = [proc.exitcode for proc in procs]
    print(f"megatron_sender: rank exit codes {codes}", flush=True)
    return code or (1 if any(c != 0 for c in codes) else 0)


if __name__ == "__main__":
    sys.exit(supervise(parse()))
