"""A stand-in trainer rank for transport tests: hub, PP-stage leader, store host.

Started as its own process tree (like the trainer Slurm job step). Rank 0 serves the control
store; all ranks also join a gloo *default* group of their own (as Megatron ranks do), so the
test proves the data-plane groups coexist with it. Every ``step``: hub ranks receive groups
(``--hub-delay-s`` each: a deliberately slow trainer), ranks meet at a default-group barrier, then
each stage leader publishes the next version from ``--source``. Writes JSON lines under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time

import torch.distributed as dist

from megatron_darl.transport import (
    TRAINER, WORKER, ChannelConfig, ControlPlaneConfig, Heartbeat, HeartbeatConfig, MemberInfo, PeerLoss, SampleHub,
    StalenessBound, Topology,
    TransportTimeout, WeightSender, WeightSyncConfig, connect_store, register, request_stop, serve_store,
    release_reservations, wait_for_exits,
)
from megatron_darl.transport.staleness import StalenessGate, admit_fresh, groups_refused
from tests.distributed.procs.sources import load_source


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name, typ, default in [
        ("port", int, 0), ("default-port", int, 0), ("rank", int, 0), ("world", int, 1),
        ("workers", int, 1), ("hubs", int, 1), ("stages", int, 1), ("steps", int, 1),
        ("gps", int, 1), ("eta", int, 0), ("hub-delay-s", float, 0.0), ("hb-interval", float, 0.25),
        ("hb-timeout", float, 4.0), ("join-timeout", float, 2.0), ("timeout", float, 60.0),
        ("drain-timeout", float, 30.0), ("channel", str, "dataplane"), ("refuse-stale", int, 0),
        ("out", str, ""), ("model-dir", str, ""), ("secret", str, ""), ("source", str, "tests.distributed.procs.sources:hf_stages"),
        ("await-workers", int, 0),
    ]:
        p.add_argument(f"--{name}", type=typ, default=default)
    return p.parse_args()


def emit(out: str, name: str, record: dict) -> None:
    with open(os.path.join(out, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> int:
    a = parse()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [trainer {a.rank}] %(message)s")
    control = ControlPlaneConfig(host="127.0.0.1", port=a.port, store_timeout_s=a.timeout, poll_interval_s=0.005,
                                 secret=a.secret)
    topology = Topology(workers=a.workers, hubs=a.hubs, stages=a.stages)
    bound = StalenessBound(max_staleness=a.eta, groups_per_step=a.gps)
    store = serve_store(control) if a.rank == 0 else connect_store(control, who=f"trainer {a.rank}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.default_port}", rank=a.rank,
                            world_size=a.world, timeout=dt.timedelta(seconds=a.timeout))
    me = MemberInfo.here(TRAINER, a.rank)
    register(store, me)
    hb_store = connect_store(control, who="loss handler")  # used from the heartbeat thread

    def on_loss(loss: PeerLoss) -> None:
        released = release_reservations(hb_store, loss.rank) if loss.role == WORKER else 0
        emit(a.out, "losses.jsonl", {"peer": loss.peer, "role": loss.role, "rank": loss.rank,
                                     "time": time.time(), "step": loss.step, "released": released})

    hb = Heartbeat(control, HeartbeatConfig(a.hb_interval, a.hb_timeout), me, on_loss=on_loss,
                   store_is_peer=None if a.rank == 0 else (TRAINER, 0)).start()
    sync_cfg = WeightSyncConfig(backend="gloo", bucket_bytes=64 * 1024, join_timeout_s=a.join_timeout,
                                collective_timeout_s=a.timeout, ack_timeout_s=a.timeout)
    sender = WeightSender(store, control, sync_cfg, topology, a.rank, hb) if a.rank < a.stages else None
    channel = ChannelConfig(transport=a.channel, connect_timeout_s=a.timeout,
                            transfer_timeout_s=a.timeout)
    hub = SampleHub(store, control, channel, topology, a.rank) if a.rank < a.hubs else None
    source = load_source(a.source)
    per_hub = a.gps // a.hubs
    if a.await_workers and a.rank == 0:
        _await_workers(a, hb, store)
    for step in range(1, a.steps + 1):
        hb.step = step
        if hub is not None:
            _receive(a, hub, store, per_hub, step)
        dist.monitored_barrier(timeout=dt.timedelta(seconds=a.timeout))
        if sender is not None:
            report = sender.publish(step, source(a.model_dir, step, a.rank, a.stages))
            emit(a.out, f"sync{a.rank}.jsonl", {**report.__dict__, "time": time.time()})
        dist.monitored_barrier(timeout=dt.timedelta(seconds=a.timeout))
    if a.rank == 0:
        request_stop(store)
        if hub is not None:
            _drain(a, hub, store, bound)
        live = [w for w in range(a.workers) if hb.is_alive(WORKER, w)]
        wait_for_exits(store, WORKER, live, a.timeout)
        if hub is not None:  # what a worker sent as it left (acked, so fenced ones are counted too)
            _drain(a, hub, store, bound, min(a.drain_timeout, 5.0))
        emit(a.out, "done.jsonl", {"steps": a.steps, "duplicates": hub.duplicates_dropped if hub else 0,
                                   "started": StalenessGate(store, bound).started(),
                                   "fenced": hub.fenced if hub else 0, **groups_refused(store)})
    dist.monitored_barrier(timeout=dt.timedelta(seconds=a.timeout))
    if hub is not None:
        hub.close()
    hb.close()
    dist.destroy_process_group()
    return 0


def _await_workers(a: argparse.Namespace, hb: Heartbeat, store) -> None:
    """``--await-workers``: every worker beats before the first step, for a scenario that needs
    them all in v1's sync (the loop itself serves whoever is live; a later one joins a later
    version)."""
    deadline = time.monotonic() + a.timeout
    while missing := [w for w in range(a.workers) if not hb.is_alive(WORKER, w)]:
        if time.monotonic() > deadline:
            raise TransportTimeout(f"workers {missing} not beating {a.timeout:.0f} s after the trainer started")
        time.sleep(0.05)
        hb.refresh(store)


def _receive(a: argparse.Namespace, hub: SampleHub, store, n: int, step: int) -> None:
    """Take ``n`` groups (as the loop's receive does, polling), each after ``--hub-delay-s``; with
    ``--refuse-stale`` only those the trainer may train at version ``step - 1`` (``admit_fresh``,
    what the loop's ``receive_groups`` calls)."""
    deadline, got = time.monotonic() + a.timeout, 0
    while got < n:
        polled = hub.poll(n - got)
        if a.refuse_stale:
            fresh = {id(g) for g in admit_fresh(store, [r.group for r in polled], step - 1, a.eta)}
            polled = [r for r in polled if id(r.group) in fresh]
        for group in polled:
            time.sleep(a.hub_delay_s)
            _record(a, hub, group, step)
            got += 1
        if time.monotonic() > deadline:
            raise TransportTimeout(f"hub {hub.hub} at step {step}: {got}/{n} groups after {a.timeout:.0f} s")
        time.sleep(0.005)


def _record(a: argparse.Namespace, hub: SampleHub, got, step: int) -> None:
    g = got.group
    emit(a.out, f"hub{hub.hub}.jsonl", {
        "group_id": g.group_id, "worker": g.worker_id, "seq": got.meta.seq, "step": step,
        "start_version": got.meta.start_version, "started_index": got.meta.started_index,
        "min_token_version": min(int(s.token_versions.min()) for s in g.samples if s.num_tokens),
        "token_versions": [s.token_versions.tolist() for s in g.samples], "time": time.time(),
    })


def _drain(a: argparse.Namespace, hub: SampleHub, store, bound: StalenessBound,
           timeout_s: float | None = None) -> None:
    """After the stop flag: take every group still in flight (workers finish what they started)."""
    started = StalenessGate(store, bound).started()
    deadline = time.monotonic() + (a.drain_timeout if timeout_s is None else timeout_s)
    seen = sum(1 for _ in open(os.path.join(a.out, f"hub{hub.hub}.jsonl")))
    while seen < started and time.monotonic() < deadline:
        for got in hub.poll():
            _record(a, hub, got, a.steps + 1)
            seen += 1
        time.sleep(0.01)
        started = StalenessGate(store, bound).started()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TransportTimeout as exc:
        logging.error("%s", exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)  # skip interpreter teardown with live gloo/heartbeat threads
