"""Sample channel: rollout workers hand framed groups to the trainer's DP hubs.

Payloads travel on the data plane (``ChannelConfig.transport="dataplane"``, the default): each
(worker, hub) pair has a two-member process group of its own (gloo on CPU, NCCL between distinct
GPUs; never the weight-sync group), built lazily and rebuilt under a new epoch when a transfer
fails. The control store carries only the small header of each transfer (first sequence number,
group count, epoch, backend, size; a transfer carries every group queued for that hub,
``links.py``), the acks and the control keys, so trainer rank 0's store is not the pipe every
sample of every worker squeezes through. ``transport="store"`` keeps the payload inside the
header value (the simple path; measured against the data plane by ``benchmarks/channel.py``).

A slow or dead worker never blocks a hub: every (worker, hub) link is a thread of its own on
both sides (``links.py``) that waits for its next header (a store wait, no polling), takes the
payload (a point-to-point receive sized from the header) and hands the group to the hub's queue;
``SampleHub.poll`` only drains that queue. A worker that dies mid-transfer costs its link thread
one failed receive, after which the pair is dropped; a frozen one costs its link the transfer
timeout. The worker side likewise sends from one thread per hub, so a generation loop waits only
on back-pressure (during which it keeps serving weight syncs), never on a transfer.

Exactly once: sequence numbers are per (worker, hub); a hub link takes seq s only after s - 1,
acks s, then deletes its header; a restarted worker resumes after the last acked seq (with the
data plane it re-posts there: a dead incarnation's unsent payloads died with it; with the store,
its posted groups still arrive, and are refused as its predecessor's generation: their starts
were given back when the new process joined) and the hub drops any group id it already delivered. A
group goes to hub ``shard_of(group_id, num_hubs, num_workers)``, the replay buffer's own shard
function: each worker deals its groups round-robin over the hubs (its g-th to hub (g + w) mod H),
so the hubs' inflows stay within about one group per worker of each other. A restarted worker
continues its group count and so its turn; a fenced generation's groups route the same way (the
hub that owns them refuses them).
Back-pressure: a worker waits while ``max_unacked_per_hub`` of its groups to one hub are unacked,
looking again after 0.5 ms and backing off to ``poll_interval_s``: once a whole window crosses in
one transfer, the link idles from its ack to the worker's next look, so that look comes soon.
Staleness accounting: a group stops being "outstanding" (``staleness.mark_delivered``) when its
hub takes it, with either transport; a group of a fenced worker generation (the worker was
declared lost, its starts given back) is refused there: acked, so the worker goes on, counted
(``SampleHub.fenced``), never handed over.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections import deque
from typing import Callable

import torch

from megatron_darl.samples import SampleGroup, shard_of
from megatron_darl.transport.config import ChannelConfig, ControlPlaneConfig
from megatron_darl.transport.cuda_ipc import device_uuid, indexed
from megatron_darl.transport.frames import GroupMeta, ReceivedGroup, frame_group
from megatron_darl.transport.links import InLink, Outgoing, OutLink
from megatron_darl.transport.shape import Topology
from megatron_darl.transport.staleness import StalenessGate, StartTicket
from megatron_darl.transport.store import (
    TRAINER, ControlStore, Keys, TransportTimeout, describe_peer, get_int,
)

CPU = torch.device("cpu")
_FIRST_WAIT_S = 0.0005  # sleep of a back-pressure wait for its first _PATIENT_S (then doubles up to poll_interval_s)
_PATIENT_S = 0.05  # an ack is due within a transfer: look every _FIRST_WAIT_S this long before backing off


def _where(device: torch.device) -> dict[str, str]:
    """This process's host and the UUID of ``device`` ("" on CPU): what picks a pair's backend."""
    return {"host": socket.gethostname(), "gpu": device_uuid(device) if device.type == "cuda" else ""}


class SampleSender:
    """Worker side of the channel.

    Args:
        gate: the worker's staleness gate (its tickets carry the generation the hub checks).
        device: the worker's GPU (its engine's), or CPU: NCCL is used only between two GPUs.
    """

    def __init__(self, store: ControlStore, control: ControlPlaneConfig, cfg: ChannelConfig, topology: Topology,
                 worker_id: int, gate: StalenessGate | None = None, device: torch.device = CPU) -> None:
        self._store, self._control, self.cfg, self.worker_id = store, control, cfg, worker_id
        self.topology = topology
        device = indexed(device)
        self._gate, self._device = gate, device
        self._next = [self._resume_seq(h) for h in range(topology.hubs)]
        # last ack read per hub (acks only grow, so it bounds the true count of unacked groups
        # from above; after a store-transport restart it lies below _next - 1)
        self._acked = [get_int(self._store, Keys.sample_ack(h, worker_id), -1)
                       for h in range(topology.hubs)]
        self._links = [OutLink(control, cfg, worker_id, h, device, self._backend_for(h))
                       for h in range(topology.hubs)]

    def _resume_seq(self, hub: int) -> int:
        """The first seq after the last acked one; with the store transport also after the groups
        an earlier incarnation posted and the hub has not consumed (they are still delivered).

        The hub may consume them while we look: a header missing above the ack we read may have
        been taken since. The hub acks before it deletes, so an ack read after the scan covers
        every header that went missing during it; scan again from there until it does not move.
        """
        ack = lambda: get_int(self._store, Keys.sample_ack(hub, self.worker_id), -1)  # noqa: E731
        seq = ack() + 1
        if self.cfg.transport != "store":
            return seq
        while True:
            while self._store.check([Keys.sample(hub, self.worker_id, seq)]):
                seq += 1
            acked = ack()
            if acked < seq:
                return seq
            seq = acked + 1

    def _backend_for(self, hub: int) -> Callable[[ControlStore], str]:
        def backend(store: ControlStore) -> str:
            if self.cfg.backend != "auto":
                return self.cfg.backend
            raw = store.read(Keys.hub_info(hub))
            there, here = json.loads(raw) if raw else {}, _where(self._device)
            distinct = there.get("host") != here["host"] or there.get("gpu") != here["gpu"]
            return "nccl" if here["gpu"] and there.get("gpu") and distinct else "gloo"
        return backend

    def unacked(self, hub: int) -> int:
        """Groups handed to ``hub``'s link and not yet acked by the hub (one store read)."""
        self._acked[hub] = get_int(self._store, Keys.sample_ack(hub, self.worker_id), -1)
        return self._next[hub] - 1 - self._acked[hub]

    def _full(self, hub: int) -> bool:
        """Whether ``hub`` has no room; reads the store only when the last ack read says full
        (an ack read once stays true: the hub only moves it forward), so a worker with room
        posts a group without a store round trip."""
        if self._next[hub] - 1 - self._acked[hub] < self.cfg.max_unacked_per_hub:
            return False
        return self.unacked(hub) >= self.cfg.max_unacked_per_hub

    def _check(self, hub: int) -> None:
        if self._links[hub].error:
            raise TransportTimeout(f"rollout {self.worker_id}: the channel to hub {hub} "
                                   f"({describe_peer(self._store, TRAINER, hub)}) failed: {self._links[hub].error}")

    def send(self, group: SampleGroup, ticket: StartTicket, while_waiting: Callable[[], None] = lambda: None,
             stopped: Callable[[], bool] = lambda: False) -> int | None:
        """Hand ``group`` to its hub's link, waiting (up to ``send_timeout_s``) for room; returns the
        hub, or ``None`` when ``stopped()`` turned true while waiting (the group is not sent).

        ``while_waiting`` runs between polls: a worker blocked by back-pressure is at a safe point
        and must keep serving weight syncs, or a trainer that publishes before it acks more
        groups would deadlock with it. ``stopped`` lets a worker leave when the trainer, which
        no longer acks, raises the stop flag.
        """
        hub = shard_of(group.group_id, self.topology.hubs, self.topology.workers)
        start = time.monotonic()
        deadline = start + self.cfg.send_timeout_s
        nap = _FIRST_WAIT_S
        while self._full(hub):
            self._check(hub)
            while_waiting()
            if stopped():
                return None
            if time.monotonic() > deadline:
                raise TransportTimeout(
                    f"rollout {self.worker_id}: hub {hub} acked nothing for {self.cfg.send_timeout_s:.0f} s "
                    f"({self.unacked(hub)} groups unacked); hub is "
                    f"{describe_peer(self._store, TRAINER, hub)} (group {group.group_id})"
                )
            time.sleep(nap)  # an ack is due within a transfer: look again soon, then back off
            if time.monotonic() - start > _PATIENT_S:
                nap = min(2 * nap, self._control.poll_interval_s)
        self._check(hub)
        seq = self._next[hub]
        meta = GroupMeta(seq=seq, start_version=ticket.version, started_index=ticket.index,
                         generation=ticket.generation)
        self._links[hub].put(Outgoing(seq, frame_group(group, meta).to_buffer(), group.group_id))
        self._next[hub] = seq + 1
        return hub

    def flush(self, timeout_s: float) -> int:
        """Wait (at most ``timeout_s``) until every group handed over is acked; returns how many
        are not. A failed link ends the wait (its groups stay unacked)."""
        deadline = time.monotonic() + timeout_s
        left = [h for h in range(self.topology.hubs) if self.unacked(h)]
        nap = _FIRST_WAIT_S
        while left and time.monotonic() < deadline:
            time.sleep(nap)
            nap = min(2 * nap, self._control.poll_interval_s)
            left = [h for h in left if self.unacked(h) and not self._links[h].error]
        return sum(self.unacked(h) for h in range(self.topology.hubs))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the links once their queues are sent (at most ``timeout_s``: they are daemons)."""
        deadline = time.monotonic() + timeout_s
        for link in self._links:
            link.close(max(0.0, deadline - time.monotonic()))


class SampleHub:
    """Trainer side of the channel, on one DP hub rank: receive, dedup, hand over.

    Args:
        hub: this hub's index (its DP replica), the shard it owns.
        device: the hub's GPU (NCCL pairs receive there), or CPU.
    """

    def __init__(self, store: ControlStore, control: ControlPlaneConfig, cfg: ChannelConfig, topology: Topology, hub: int,
                 device: torch.device = CPU) -> None:
        self._store, self._control, self.cfg, self.hub = store, control, cfg, hub
        self.topology = topology
        device = indexed(device)
        store.set(Keys.hub_info(hub), json.dumps(_where(device)))
        self._arrived: queue.SimpleQueue[ReceivedGroup] = queue.SimpleQueue()
        self._waiting: deque[ReceivedGroup] = deque()
        self._delivered: set[int] = set()
        self.duplicates_dropped = 0  # groups received twice and dropped (exactly-once guard)
        self._stop = threading.Event()
        self._links = [InLink(control, cfg, hub, w, device, self._arrived.put, self._stop)
                       for w in range(topology.workers)]

    @property
    def fenced(self) -> int:
        """Groups refused over all links: sent by a worker generation declared lost (fenced)."""
        return sum(link.fenced for link in self._links)

    @property
    def transfers_received(self) -> int:
        """Transfers taken over all links (with the data plane one carries every group queued)."""
        return sum(link.transfers for link in self._links)

    def settled(self) -> bool:
        """No link is between the ledger's ``arrive`` of a transfer and handing its groups over.

        Asked before a ``poll``: when True, every group the ledger counted as delivered before the
        call (``staleness.bound_filled`` reads that count) is in that poll; when False, the ledger
        may count groups that the poll misses, so the count says nothing yet about this hub."""
        return not any(link.handing_over for link in self._links)

    def poll(self, max_groups: int = 1 << 30) -> list[ReceivedGroup]:
        """Take every group that arrived, at most ``max_groups``, in arrival order; never blocks."""
        while True:
            try:
                self._waiting.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        out: list[ReceivedGroup] = []
        while self._waiting and len(out) < max_groups:
            got = self._waiting.popleft()
            if got.group.group_id in self._delivered:
                self.duplicates_dropped += 1
                continue
            self._delivered.add(got.group.group_id)
            out.append(got)
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the links (each notices within a second; one stuck in a transfer is a daemon)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for link in self._links:
            link.thread.join(max(0.0, deadline - time.monotonic()))
