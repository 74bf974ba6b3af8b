"""Sample channel: rollout workers post framed groups; each trainer DP hub collects its own.

Choice (measured with ``benchmarks/channel.py``): groups travel as bytes through the control-plane
TCPStore, one key per (hub, worker, seq). Why: a hub sweeps all workers with non-blocking
``check`` calls and takes whatever is ready, so it never waits on one slow worker, a dead
worker's posted groups are still delivered, and no data-plane collective (which would block on
its slowest member) sits on the sample path. A group is a few hundred KB, far below the store's
throughput; weights, which are GBs, use the NCCL data plane (``weight_sync``).

Exactly once: sequence numbers are per (worker, hub); the hub consumes seq s only after s-1,
deletes the key, then acks s; a restarted worker resumes after the last acked seq and the hub
drops any group id it already delivered. A group goes to hub ``shard_of(group_id, num_hubs)``,
the same function the replay buffer uses for its DP shards. Back-pressure: a worker waits while
``max_unacked_per_hub`` of its groups to one hub are unacked.
"""

from __future__ import annotations

import time
from typing import Callable

from megatron_darl.samples import SampleGroup, shard_of  # the replay buffer's owner: hub == DP shard
from megatron_darl.transport.config import ChannelConfig, ControlPlaneConfig
from megatron_darl.transport.frames import GroupFrame, GroupMeta, ReceivedGroup, frame_group, unframe_group
from megatron_darl.transport.staleness import StartTicket
from megatron_darl.transport.store import (
    TRAINER, WORKER, ControlStore, Keys, TransportTimeout, describe_peer, get_int,
)

class SampleSender:
    """Worker side of the channel."""

    def __init__(
        self, store: ControlStore, control: ControlPlaneConfig, cfg: ChannelConfig, worker_id: int
    ) -> None:
        self._store, self._control, self.cfg, self.worker_id = store, control, cfg, worker_id
        self._next = [self._resume_seq(h) for h in range(control.num_hubs)]

    def _resume_seq(self, hub: int) -> int:
        seq = get_int(self._store, Keys.sample_ack(hub, self.worker_id), -1) + 1
        while self._store.check([Keys.sample(hub, self.worker_id, seq)]):
            seq += 1  # posted before a restart and not consumed yet: keep them, go past
        return seq

    def unacked(self, hub: int) -> int:
        """Groups posted to ``hub`` and not yet acked."""
        acked = get_int(self._store, Keys.sample_ack(hub, self.worker_id), -1)
        return self._next[hub] - 1 - acked

    def send(self, group: SampleGroup, ticket: StartTicket, while_waiting: Callable[[], None] = lambda: None,
             stopped: Callable[[], bool] = lambda: False) -> int | None:
        """Post ``group`` to its hub, waiting (up to ``send_timeout_s``) for room; returns the hub,
        or ``None`` when ``stopped()`` turned true while waiting (the group is not posted).

        ``while_waiting`` runs between polls: a worker blocked by back-pressure is at a safe point
        and must keep serving weight syncs, or a trainer that publishes before it acks more
        groups would deadlock with it. ``stopped`` lets a worker leave when the trainer, which
        no longer acks, raises the stop flag.
        """
        hub = shard_of(group.group_id, self._control.num_hubs)
        deadline = time.monotonic() + self.cfg.send_timeout_s
        while self.unacked(hub) >= self.cfg.max_unacked_per_hub:
            while_waiting()
            if stopped():
                return None
            if time.monotonic() > deadline:
                raise TransportTimeout(
                    f"rollout {self.worker_id}: hub {hub} acked nothing for {self.cfg.send_timeout_s:.0f} s "
                    f"({self.unacked(hub)} groups unacked); hub is "
                    f"{describe_peer(self._store, TRAINER, hub)} (group {group.group_id})"
                )
            time.sleep(self._control.poll_interval_s)
        seq = self._next[hub]
        meta = GroupMeta(seq=seq, start_version=ticket.version, started_index=ticket.index)
        self._store.set(Keys.sample(hub, self.worker_id, seq), frame_group(group, meta).to_bytes())
        self._next[hub] = seq + 1
        return hub


class SampleHub:
    """Trainer side of the channel, on one DP hub rank: collect, dedup, ack.

    Args:
        hub: this hub's index (its DP replica), the shard it owns.
    """

    def __init__(self, store: ControlStore, control: ControlPlaneConfig, hub: int) -> None:
        self._store, self._control, self.hub = store, control, hub
        n = control.num_workers
        self._next = [get_int(store, Keys.sample_ack(hub, w), -1) + 1 for w in range(n)]
        self._delivered: set[int] = set()
        self._turn = 0
        self._pending: list[ReceivedGroup] = []
        self.duplicates_dropped = 0  # groups received twice and dropped (exactly-once guard)

    def poll(self, max_groups: int = 1 << 30) -> list[ReceivedGroup]:
        """Take every group that is ready now, sweeping workers round-robin; never blocks."""
        out: list[ReceivedGroup] = []
        n = self._control.num_workers
        progress = True
        while progress and len(out) < max_groups:
            progress = False
            for i in range(n):
                w = (self._turn + i) % n
                got = self._take(w)
                if got is not None:
                    progress = True
                    if got.group.group_id not in self._delivered:
                        self._delivered.add(got.group.group_id)
                        out.append(got)
                    else:
                        self.duplicates_dropped += 1
                    if len(out) >= max_groups:
                        break
            self._turn = (self._turn + 1) % n
        return out

    def _take(self, worker: int) -> ReceivedGroup | None:
        key = Keys.sample(self.hub, worker, self._next[worker])
        data = self._store.read(key)  # None: not posted yet (or not signed by the run: ignored)
        if data is None:
            return None
        got = unframe_group(GroupFrame.from_bytes(data))
        if got.meta.seq != self._next[worker] or got.group.worker_id != worker:
            raise ValueError(
                f"hub {self.hub}: key {key} holds seq {got.meta.seq} of worker {got.group.worker_id}"
            )
        self._store.delete_key(key)
        self._store.set(Keys.sample_ack(self.hub, worker), str(self._next[worker]))
        self._next[worker] += 1
        return got

    def receive(self, n: int, timeout_s: float, step: int = -1) -> list[ReceivedGroup]:
        """Block until ``n`` groups arrived; on timeout name the workers and the step.

        Groups taken before a timeout are kept and returned by the next call (never lost).
        """
        out = self._pending
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            out += self.poll(n - len(out))
            if len(out) >= n:
                break
            if time.monotonic() > deadline:
                peers = ", ".join(describe_peer(self._store, WORKER, w) for w in range(self._control.num_workers))
                raise TransportTimeout(
                    f"hub {self.hub} at step {step}: {len(out)}/{n} groups after {timeout_s:.0f} s "
                    f"from rollout workers [{peers}]"
                )
            time.sleep(self._control.poll_interval_s)
        self._pending = out[n:]
        return out[:n]
