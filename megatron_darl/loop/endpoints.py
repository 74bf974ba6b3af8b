"""A trainer rank's ends of the transport, and the few collectives the loop adds on top.

Rank 0 serves the control-plane store; every rank registers and beats. The replica's hub
(TP 0, first PP stage) owns a ``SampleHub`` (its DP shard of the groups); the leader of each PP
stage in DP replica 0 (TP 0) owns a ``WeightSender``. Hubs agree on "enough groups arrived" with
a sum over the hubs' gloo DP group, and hand the groups to the other ranks of their replica with
one object broadcast, so every rank of a replica holds the same planner state and builds the
same batches without further traffic.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_darl.samples import SampleGroup
from megatron_darl.transport import (
    TRAINER, WORKER, Heartbeat, MemberInfo, PeerLoss, SampleHub, TransportConfig, TransportTimeout,
    WeightSender, connect_store, register, serve_store,
)
from megatron_darl.transport.store import wait_key

log = logging.getLogger(__name__)
EXIT_RANK0_LOST = 3  # a trainer rank whose rank 0 (the store host) is frozen or gone


@dataclass
class TrainerEndpoints:
    """What one trainer rank holds of the transport."""

    store: Any  # transport.ControlStore (the store is served by rank 0)
    heartbeat: Heartbeat  # this rank's beat and the watch on rollout workers
    hub: SampleHub | None  # this replica's shard of the sample channel (hub ranks only)
    sender: WeightSender | None  # this PP stage's weight broadcast (stage leaders only)
    me: MemberInfo  # this rank's rendezvous record

    def close(self) -> None:
        self.heartbeat.close()


def _release_on_loss(transport: TransportConfig):
    """Heartbeat callback: name the lost worker and give back its staleness reservations."""
    from megatron_darl.transport.staleness import release_reservations

    store = connect_store(transport.control, who="trainer 0 loss handler")

    def on_loss(loss: PeerLoss) -> None:
        released = release_reservations(store, loss.rank) if loss.role == WORKER else 0
        log.error("lost %s (silent %.1f s at step %d); released %d reservations", loss.peer,
                  loss.silent_s, loss.step, released)

    return on_loss


def _exit_on_rank0_loss(loss: PeerLoss) -> None:
    """Heartbeat callback of ranks > 0: rank 0 frozen or gone means the job cannot go on."""
    if (loss.role, loss.rank) == (TRAINER, 0):
        log.error("lost %s (silent %.1f s at step %d); exiting %d", loss.peer, loss.silent_s,
                  loss.step, EXIT_RANK0_LOST)
        logging.shutdown()
        os._exit(EXIT_RANK0_LOST)


def open_endpoints(transport: TransportConfig, ps) -> TrainerEndpoints:
    """Serve or join the store, start the heartbeat, and open this rank's hub/sender."""
    control = transport.control
    is_hub = ps.tp_rank == 0 and ps.pp_rank == 0
    store = serve_store(control) if ps.rank == 0 else connect_store(control, who=f"trainer {ps.rank}")
    me = MemberInfo.here(TRAINER, ps.rank)
    register(store, me)
    on_loss = _release_on_loss(transport) if ps.rank == 0 else _exit_on_rank0_loss
    hb = Heartbeat(control, transport.heartbeat, me, on_loss=on_loss,
                   store_is_peer=None if ps.rank == 0 else (TRAINER, 0)).start()
    hub = SampleHub(store, control, ps.dp_rank) if is_hub else None
    leader = ps.tp_rank == 0 and ps.dp_rank == 0
    sender = WeightSender(store, control, transport.weight_sync, ps.pp_rank, hb,
                          device=ps.device) if leader else None
    return TrainerEndpoints(store, hb, hub, sender, me)


def dp_sum(tensor: torch.Tensor, ps) -> torch.Tensor:
    """Sum a CPU tensor over this rank's DP group (gloo); identity at DP 1."""
    if ps.dp_size > 1:
        dist.all_reduce(tensor, group=ps.dp_group_gloo)
    return tensor


def dp_max(tensor: torch.Tensor, ps) -> torch.Tensor:
    if ps.dp_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=ps.dp_group_gloo)
    return tensor


def receive_groups(ep: TrainerEndpoints, ps, need: int, timeout_s: float, step: int,
                   poll_s: float, stop: Callable[[], bool] = lambda: False) -> list[SampleGroup] | None:
    """This replica's new groups once the hubs together hold ``need``; same list on every rank.

    Hubs poll their shard and sum the counts over DP until ``need`` arrived (so an uneven hash
    split never stalls a hub waiting for its "share"); then each hub broadcasts its groups to
    the other ranks of its replica. Returns None on every rank when any hub's ``stop()`` turned
    true while waiting (a signal: checkpoint without this step; its groups are not kept).
    """
    groups: list[SampleGroup] | None = []
    if ep.hub is not None:
        deadline = time.monotonic() + timeout_s
        while True:
            groups += [r.group for r in ep.hub.poll()]
            counts = dp_sum(torch.tensor([len(groups), int(stop())], dtype=torch.int64), ps)
            total = int(counts[0])
            if int(counts[1]):
                groups = None
                break
            if total >= need:
                break
            if time.monotonic() > deadline:
                raise TransportTimeout(
                    f"trainer step {step}: {total}/{need} groups after {timeout_s:.0f} s "
                    f"(hub {ps.dp_rank} holds {len(groups)}); are the rollout workers alive?"
                )
            time.sleep(poll_s)
    if ps.tp_size * ps.pp_size > 1:
        box = [groups]
        src = dist.get_global_rank(ps.model_parallel_group, 0)
        dist.broadcast_object_list(box, src=src, group=ps.model_parallel_group)
        groups = box[0]
    return groups


def wait_for_workers(ep: TrainerEndpoints, ps, num_workers: int, timeout_s: float, tag: int = 0) -> None:
    """Rank 0 waits until every rollout worker beats (so a publish reaches them), then all
    trainer ranks go on: used before re-publishing resumed weights to fresh workers.

    The other ranks wait on a store key rank 0 sets (with a margin over ``timeout_s``), not on a
    process-group barrier, whose own timeout could fire first while rank 0 is still waiting.
    """
    key = f"loop/workers_ready/{tag}"
    if ps.rank == 0:
        deadline = time.monotonic() + timeout_s
        while not all(ep.heartbeat.is_alive(WORKER, w) for w in range(num_workers)):
            if time.monotonic() > deadline:
                missing = [w for w in range(num_workers) if not ep.heartbeat.is_alive(WORKER, w)]
                log.warning("rollout workers %s not up after %.0f s; publishing anyway", missing, timeout_s)
                break
            ep.heartbeat.refresh(ep.store)
            time.sleep(0.05)
        ep.store.set(key, "1")
    else:
        wait_key(ep.store, key, timeout_s + 60.0, "trainer rank 0 to see the rollout workers")


def publish_weights(ep: TrainerEndpoints, trainer, ps) -> float:
    """Export this stage's HF tensors (a TP collective) and broadcast them; seconds (stage 0)."""
    if ps.dp_rank != 0:
        return 0.0
    named = trainer.export_hf_stage()
    if ep.sender is None:  # other TP ranks of the stage: take part in the export's gathers
        for _ in named:
            pass
        return 0.0
    report = ep.sender.publish(trainer.version, named)
    # The sender stops reading early when no worker joined or a broadcast timed out; the
    # export is a TP collective, so run it to the end or the other TP ranks hang in a gather.
    for _ in named:
        pass
    if report.missing:
        log.warning("weight sync v%d: missing %s", trainer.version, report.missing)
    return float(report.seconds)
