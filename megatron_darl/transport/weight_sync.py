"""Weight sync: each trainer PP-stage leader sends HF-named full tensors to every rollout worker.

Protocol for version v (store keys under ``ws/``), per stage s, no disk, no pickles:

1. the stage-s leader offers v (offer n: keys live under n, ``weight_protocol.py``); each live
   worker that holds an older version, at its next safe point (between generation steps), sees
   stage 0's offer and posts "ready for n" once, for all stages, with the UUID of its GPU and
   its process (host, pid); it then takes the stages in order (a later stage's leader waits);
2. the leader waits for every live worker (heartbeat) to be ready, at most ``join_timeout_s``,
   names the missing ones, and posts a plan: the members and their processes, which of them
   share the leader's GPU (``ipc``), the backend and a group epoch for the others. The
   data-plane group {leader s} + broadcast members is rebuilt only when they (their processes)
   change (a dead worker never blocks a later sync; a stalled one delays a sync by at most
   ``join_timeout_s``). Backend ``auto`` is NCCL when the leader and every broadcast member hold
   distinct GPUs, else gloo (NCCL refuses two ranks on one device);
3. the leader streams buckets of ~``bucket_bytes`` (``buckets.py``): a small JSON header per
   bucket in the store (names, dtypes, shapes, byte offsets, and for ``ipc`` members a CUDA IPC
   handle of the buffer, ``cuda_ipc.py``) and one flat uint8 buffer broadcast over the group;
   the next bucket is packed while the previous one is in flight. A worker on the leader's GPU
   maps the buffer through the handle, loads from it and says "done" so the leader can free it;
4. each worker loads every bucket in place (``Engine.load_weights``) and, once all stages are in,
   acks v; the coordinator (stage 0 leader) moves the published version to v when every live
   member acked (dead ones are reported by name and dropped) and at least one did. A worker that
   missed the sync keeps its old weights but generates nothing while they are older than the
   published version; one that missed only some stages holds no valid version until the next.

A publish may send staged weights (``stage_weights``: every bucket packed ahead, so the trainer can go
on while a thread publishes, ``weight_publisher.py``), and may send a newer staged version than it
offered (``upgrade``): the plan names the version sent, which the workers load and ack; keys
stay under the offer.

Failures are loud (docs/architecture.md, Failures): a worker whose engine cannot load the weights posts
why and exits (``WeightLoadError``); a sync that no ready worker could take raises
``WeightSyncFailed`` on the leader with each worker's reason, so the trainer checkpoints and
stops instead of training on while every worker waits for weights that never come.

A member that dies in a round (lost by heartbeat, or another process of its id beats in its
place: restarted) is that worker's loss, not the sync's: it is named, the round's other members
are served again, and the publish goes on without it; a restarted process is a new member (its
own tries) that the leader serves like any late worker. The leader's wait on a gloo bucket
watches its members: one that posted its failure of the round (it walked away from the
broadcast) or died ends the round at once, so the leader does not wait for that member's socket
to close or for the collective timeout.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import time
from functools import partial
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_darl.transport.buckets import buckets, pack
from megatron_darl.transport.config import ControlPlaneConfig, WeightSyncConfig
from megatron_darl.transport.cuda_ipc import device_uuid, share
from megatron_darl.transport.heartbeat import Heartbeat
from megatron_darl.transport.process_group import DataPlaneGroup, build_group
from megatron_darl.transport.shape import Topology
from megatron_darl.transport.store import (
    WORKER, ControlStore, TransportTimeout, describe_peer, get_int, publish_version,
    wait_key,
)
from megatron_darl.transport.weight_protocol import (  # noqa: F401 (re-exported: the sender's vocabulary)
    PackedBucket, StagedWeights, SyncKeys, SyncReport, WeightLoadError, WeightSyncFailed, offer_value,
)

log = logging.getLogger(__name__)
Proc = tuple[str, int]  # a worker's process: (host, pid)
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Callable[[], Iterable[tuple[str, torch.Tensor]]]


class WeightSender:
    """One trainer PP-stage leader's end of weight sync.

    Args:
        stage: this leader's PP stage; stage 0 is the coordinator that moves the published version.
        heartbeat: the trainer's heartbeat, which watches the workers (who is live).
        device: where buckets are packed (the leader's GPU; None: the group's device, or the
            current CUDA device when a worker shares it).
    """

    def __init__(
        self, store: ControlStore, control: ControlPlaneConfig, cfg: WeightSyncConfig, topology: Topology, stage: int,
        heartbeat: Heartbeat, device: torch.device | None = None,
    ) -> None:
        if not 0 <= stage < topology.stages:
            raise ValueError(f"stage {stage} outside 0..{topology.stages - 1}")
        self._store, self._control, self.cfg, self.stage, self.topology = store, control, cfg, stage, topology
        self._hb = heartbeat
        for w in range(topology.workers):
            heartbeat.watch(WORKER, w)
        heartbeat.refresh(store)
        # data-plane groups by (backend, broadcast members, their processes), built once each:
        # rounds to different subsets of workers reuse them; a member that fails takes its groups with it
        self._groups: dict[tuple, tuple[int, DataPlaneGroup]] = {}
        self._epoch = 0  # store prefix counter of this stage's groups
        self._device = device
        self._gpu = device_uuid(device)  # "" on CPU: no worker can share it
        self._host = socket.gethostname()
        self._path = ""  # how the last sync reached its members (logged when it changes)
        self.offers = 0  # publishes so far: the number of the current offer
        self._planned: dict[int, Proc | None] = {}  # worker -> the process its last plan named

    def stage_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> StagedWeights:
        """Pack every bucket of ``named_tensors`` now, on this sender's device, in the caller's
        stream order (later in-place updates of the source cannot change what is sent)."""
        device = self._device if self._device is not None else torch.device("cpu")
        packed = [pack(bucket, device) for bucket in buckets(named_tensors, self.cfg.bucket_bytes)]
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        return StagedWeights(version, packed, ready, sum(e.nbytes for es, _ in packed for e in es))

    def publish(self, version: int, named_tensors: NamedTensors | StagedWeights,
                upgrade: Callable[[], StagedWeights] | None = None,
                newer: Callable[[], bool] = lambda: False) -> SyncReport:
        """Send this stage's HF-named full tensors as ``version``; stage 0 also collects acks and
        moves the published version as soon as one worker holds it.

        Workers are served in rounds, each to the ones at a safe point then (those that come
        within ``gather_s`` of the first share a broadcast), so a worker never waits for another
        to finish its generation; every live worker gets ``join_timeout_s`` from the offer to come
        (and again after a round it failed).
        ``named_tensors`` is a list, ``StagedWeights``, or a zero-argument callable returning a
        fresh iterator (the trainer's export); each can be sent again, to later rounds and to a
        member that failed (a worker died mid-broadcast: up to ``max_attempts`` tries each). A
        one-shot iterator (the blocking publish's export, a TP collective its peers iterate once)
        serves one round, which waits for every live worker up to ``join_timeout_s``: a second
        round would have nothing to send. ``upgrade`` gives the newest staged weights (at least
        ``version``) for each round: the plan and the report name the version sent. Once a round
        went out, ``newer()`` true ends the publish: the workers still to come get the newer version
        from the next one, offered as soon as this one returns.
        Raises ``WeightSyncFailed`` when every worker that took part failed and one of them
        still runs (or its engine could not load the weights), or (stage 0) none of the living
        loaded the version; members that died are named in the report, and with no worker ready
        within ``join_timeout_s`` the version is not published and the report names the ones left out.
        """
        start = time.monotonic()
        deadline = start + self.cfg.join_timeout_s
        self.offers += 1
        offer = self.offers
        self._store.set(SyncKeys.offer(self.stage), offer_value(offer, version))
        report = SyncReport(version=version, stage=self.stage, members=[])
        retriable = callable(named_tensors) or isinstance(named_tensors, (list, tuple, StagedWeights))
        done: set[tuple[int, Proc | None]] = set()  # worker processes served, or given up on
        tries: dict[tuple[int, Proc | None], int] = {}  # failed rounds per worker process
        given_up: set[tuple[int, Proc | None]] = set()  # worker processes that failed for good
        acks = _Acks(self, offer, report) if self.stage == 0 else None
        for rnd in itertools.count():
            todo = self._todo(version, done)
            waited = time.monotonic()
            if any((w, self._proc(w)) in tries for w in todo):  # failed: a fresh window to come back
                deadline = max(deadline, waited + self.cfg.join_timeout_s)
            # a one-shot source serves one round: it waits for every live worker (up to the join
            # deadline), where a round of a re-sendable one goes at gather_s after the first
            members, waiting = self._gather_ready(offer, rnd, todo, deadline, acks, gather_all=not retriable)
            report.wait_seconds += time.monotonic() - waited
            ok, sent = [], version
            if members:
                source = upgrade() if upgrade is not None else named_tensors
                ok, sent = self._round(offer, version, rnd, members, source, report)
                done |= {(w, self._planned.get(w)) for w in ok}
                for w in set(members) - set(ok):
                    key = (w, self._planned.get(w))
                    tries[key] = tries.get(key, 0) + 1
                    if (not retriable or tries[key] >= self.cfg.max_attempts or self._dead(w)
                            or self._gave_up(offer, w)):
                        done.add(key)
                        given_up.add(key)
                        report.missing.append(self._failure(offer, w))
            else:  # nobody (more) came: an empty plan, so a late walker learns it missed this offer
                self._store.set(SyncKeys.plan(offer, self.stage, rnd), json.dumps({"members": []}))
                if waiting:
                    self._left_out(version, waiting, report)
            if members and waiting and not retriable:  # its round is over: nothing left to send them
                self._left_out(version, waiting, report)
            more = members and retriable and not newer() and bool(self._todo(version, done))
            self._store.set(SyncKeys.verdict(offer, self.stage, rnd), "1" if more else "0")
            if acks is not None:  # polled, not awaited: a member may still be in another stage's round
                acks.expect(ok, sent)
            if not more:
                report.attempts = rnd + 1
                break
        if acks is not None:
            acks.wait(self.cfg.ack_timeout_s)
        self._conclude(offer, given_up, report)
        report.seconds = time.monotonic() - start
        return report

    def waiting_for(self, version: int) -> list[int]:
        """Live workers that reached a safe point for the current offer after its rounds ended
        (a restarted process, or one too late for them) and hold weights older than ``version``:
        whom offering ``version`` again would serve at once."""
        if not self.offers:
            return []
        return [w for w in self._todo(version, set())
                if _proc(self._ready_info(self.offers, w)) == self._proc(w)]

    def _todo(self, version: int, done: set) -> list[int]:
        """Live workers whose process is not served or given up on, and that hold an older version."""
        return [w for w in self._live_workers() if (w, self._proc(w)) not in done
                and get_int(self._store, SyncKeys.ack(w), -1) < version]

    def _proc(self, worker: int) -> Proc | None:
        """The worker's process beating now (None before its first beat)."""
        member = self._hb.member(WORKER, worker)
        return None if member is None else (member.host, member.pid)

    def _dead(self, worker: int) -> bool:
        """The process the last plan named for ``worker`` is gone."""
        return self._gone(worker, self._planned.get(worker))

    def _round(self, offer: int, version: int, rnd: int, members: list[int],
               source: NamedTensors | StagedWeights, report: SyncReport) -> tuple[list[int], int]:
        """Send ``source`` to ``members``: (those that loaded it, the version sent)."""
        sent = source.version if isinstance(source, StagedWeights) else version
        began = time.monotonic()
        failed = self._attempt(offer, rnd, members, source() if callable(source) else source, report, sent)
        report.transfer_seconds += time.monotonic() - began
        report.rounds_sent += 1
        ok = [w for w in members if w not in failed]
        report.members = sorted(set(report.members) | set(ok))
        if ok:
            report.version = max(report.version, sent)
        return ok, sent

    def _left_out(self, version: int, waiting: list[int], report: SyncReport) -> None:
        missing = [describe_peer(self._store, WORKER, w) for w in waiting]
        log.error("weight sync v%d stage %d: not ready after %.1f s, left out until the next sync: %s",
                  version, self.stage, self.cfg.join_timeout_s, "; ".join(missing))
        report.missing += missing

    def _conclude(self, offer: int, given_up: set, report: SyncReport) -> None:
        """Fail loudly when none loaded the version and a member that still runs was given up on
        (or its engine cannot load it). Members that died are losses, named, not the sync's
        failure; one that failed once before a newer version ended the publish takes that one."""
        if not report.members and given_up:
            reasons = "; ".join(self._failure(offer, w) for w, _ in sorted(given_up, key=lambda k: k[0]))
            if any(not self._gone(w, proc) or self._cannot_load(offer, w) for w, proc in given_up):
                raise WeightSyncFailed(f"weight sync v{report.version} stage {self.stage} failed for every "
                                       f"rollout worker: {reasons}")
            log.error("weight sync v%d stage %d: every member died mid-sync (%s); the others take the "
                      "next sync", report.version, self.stage, reasons)
        if self.stage == 0 and not report.members:
            log.error("weight sync v%d: no live rollout worker took part; published version stays", report.version)
        elif self.stage == 0 and not report.acked and any(not self._dead(w) for w in report.members):
            raise WeightSyncFailed(f"weight sync v{report.version}: no rollout worker loaded it: "
                                   f"{'; '.join(report.missing)}")

    def _cannot_load(self, offer: int, worker: int) -> bool:
        """The worker's engine could not load the weights (it posted why, and exits)."""
        key = SyncKeys.failed(offer, worker)
        return self._store.check([key]) and self._store.get(key) != b"1"

    def _gone(self, worker: int, proc: Proc | None) -> bool:
        """Worker process ``proc`` is gone (silent, or another process beats as ``worker``)."""
        now = self._proc(worker)
        return self._hb.is_lost(WORKER, worker) or (proc is not None and now is not None and now != proc)

    # ---- one attempt --------------------------------------------------------------------------
    def _attempt(self, offer: int, attempt: int, members: list[int],
                 source: Iterable[tuple[str, torch.Tensor]] | StagedWeights, report: SyncReport,
                 sent: int) -> list[int]:
        """One round of the stage to ``members``; returns the members it failed for."""
        ipc = [w for w in members if self._shares_gpu(offer, w)]
        bcast = [w for w in members if w not in ipc]
        backend = self._backend(offer, bcast)
        self._planned.update({w: _proc(self._ready_info(offer, w, attempt)) for w in members})
        # a group is of member processes: a restarted worker never inherits its predecessor's
        group_key = (backend, tuple(bcast), tuple(self._planned[w] for w in bcast))
        cached = self._groups.get(group_key) if bcast else None
        if bcast and cached is None:
            self._epoch += 1
        epoch = cached[0] if cached is not None else self._epoch
        procs = {str(w): self._planned[w] for w in members}  # whom the plan serves
        plan = {"epoch": epoch, "members": members, "procs": procs, "ipc": ipc, "backend": backend, "version": sent}
        self._store.set(SyncKeys.plan(offer, self.stage, attempt), json.dumps(plan))
        report.ipc = sorted(set(report.ipc) | set(ipc))
        path = f"CUDA IPC to {ipc}, {backend} broadcast to {bcast}" if ipc and bcast else (
            f"CUDA IPC to {ipc}" if ipc else f"{backend} broadcast to {bcast}")
        if path != self._path:
            log.info("weight sync stage %d: %s", self.stage, path)
            self._path = path
        group = None
        try:
            if bcast and cached is None:
                group = build_group(self._store, f"ws/{self.stage}/{epoch}", 0, len(bcast) + 1,
                                    backend, self.cfg.collective_timeout_s)
                self._groups[group_key] = (epoch, group)
            elif cached is not None:
                group = cached[1]
            report.buckets, report.bytes = self._stream(offer, sent, attempt, source, ipc, bcast, group)
        except TransportTimeout as exc:
            log.error("weight sync v%d stage %d round %d failed, members %s: %s",
                      sent, self.stage, attempt, members, exc)
        failed = self._member_results(offer, attempt, members)
        if failed:  # a member died or failed: its end of every group it is in is gone
            for key in [k for k in self._groups if set(k[1]) & set(failed)]:
                self._groups.pop(key)[1].retire()
        return failed

    def _ready_info(self, offer: int, worker: int, rnd: int = 0) -> dict:
        """What a worker posted with "ready" (for round ``rnd``): its GPU UUID, host and pid."""
        key = SyncKeys.ready(offer, worker) if rnd == 0 else SyncKeys.retry_ready(offer, self.stage, rnd, worker)
        try:
            info = json.loads(self._store.read(key) or b"{}")
        except (ValueError, RuntimeError, dist.DistError):
            return {}
        return info if isinstance(info, dict) else {}

    def _shares_gpu(self, offer: int, worker: int) -> bool:
        """The worker sits on this leader's GPU (same host, same device UUID) and IPC is on."""
        if self.cfg.colocated != "ipc" or not self._gpu:
            return False
        info = self._ready_info(offer, worker)
        return info.get("gpu") == self._gpu and info.get("host") == self._host

    def _backend(self, offer: int, bcast: list[int]) -> str:
        """The configured backend, or for ``auto`` NCCL when every member holds its own GPU."""
        if self.cfg.backend != "auto":
            return self.cfg.backend
        gpus = [self._ready_info(offer, w).get("gpu", "") for w in bcast]
        distinct = len(set(gpus) | {self._gpu}) == len(gpus) + 1
        return "nccl" if self._gpu and all(gpus) and distinct else "gloo"

    def _member_results(self, offer: int, attempt: int, members: list[int]) -> list[int]:
        """Members that did not load this attempt (reported failure, died, or silent past the timeout)."""
        deadline = time.monotonic() + self.cfg.collective_timeout_s
        results: dict[int, bool] = {}
        while len(results) < len(members) and time.monotonic() < deadline:
            self._hb.refresh(self._store)
            for w in members:
                if w not in results and (loaded := self._outcome(offer, attempt, w)) is not None:
                    results[w] = loaded
            time.sleep(self._control.poll_interval_s)
        return [w for w in members if not results.get(w, False)]

    def _outcome(self, offer: int, attempt: int, worker: int) -> bool | None:
        """Whether ``worker`` loaded this attempt: what it posted, False once it gave up the offer
        or is gone, None while neither is known."""
        key = SyncKeys.result(offer, self.stage, attempt, worker)
        if self._store.check([key]):
            return self._store.get(key) == b"1"
        return False if self._dead(worker) or self._gave_up(offer, worker) else None

    def _gave_up(self, offer: int, worker: int) -> bool:
        """The worker posted that it failed this offer (e.g. its engine could not load it)."""
        return bool(self._store.check([SyncKeys.failed(offer, worker)]))

    def _failure(self, offer: int, worker: int) -> str:
        """Why ``worker`` did not take ``offer``, naming it (role, rank, host, pid)."""
        key = SyncKeys.failed(offer, worker)
        if self._store.check([key]):
            reason = self._store.get(key).decode(errors="replace")
            if reason != "1":
                return reason
        planned, now = self._planned.get(worker), self._proc(worker)
        if planned is not None and now is not None and now != planned:
            return (f"{WORKER} {worker} ({planned[0]}, pid {planned[1]}): died (pid {now[1]} now beats "
                    f"as rollout {worker}: restarted)")
        peer = describe_peer(self._store, WORKER, worker)
        if self._hb.is_lost(WORKER, worker):
            return f"{peer}: lost (no heartbeat)"
        return f"{peer}: did not receive the weights (see its log)"

    def _live_workers(self) -> list[int]:
        self._hb.refresh(self._store)
        return [w for w in range(self.topology.workers) if self._hb.is_alive(WORKER, w)]

    def _gather_ready(self, offer: int, rnd: int, todo: list[int], deadline: float,
                      acks: "_Acks | None" = None, gather_all: bool = False) -> tuple[list[int], list[int]]:
        """(ready, waiting) among ``todo``: returns once all are at a safe point, ``gather_s``
        after the first one was (not with ``gather_all``), or at ``deadline`` (with whoever is
        ready). A worker stuck before its safe point is not the sync's to judge: the loop's
        progress watch names it if it never comes back."""
        first = None
        while True:
            ready = [w for w in todo if self._store.check([
                SyncKeys.ready(offer, w) if rnd == 0 else SyncKeys.retry_ready(offer, self.stage, rnd, w)])]
            waiting = [w for w in todo if w not in ready]
            now = time.monotonic()
            first = first if first is not None or not ready else now
            gathered = first is not None and not gather_all and now - first >= self.cfg.gather_s
            if not waiting or now > deadline or gathered:
                return ready, waiting
            time.sleep(self._control.poll_interval_s)
            self._hb.refresh(self._store)
            todo = [w for w in todo if not self._hb.is_lost(WORKER, w)]
            if acks is not None:  # the published version moves while later workers are awaited
                acks.poll()

    # ---- streaming ----------------------------------------------------------------------------
    def _stream(self, offer: int, version: int, attempt: int,
                source: Iterable[tuple[str, torch.Tensor]] | StagedWeights, ipc: list[int],
                bcast: list[int], group: DataPlaneGroup | None) -> tuple[int, int]:
        state = {"n": 0, "attempt": attempt, "offer": offer, "version": version, "bcast": bcast}
        try:
            return self._stream_buckets(self._packed(source, ipc, group), state, ipc, group)
        except TransportTimeout:
            key = SyncKeys.bucket(offer, self.stage, attempt, state["n"])
            self._store.set(key, json.dumps({"last": True, "aborted": True}))
            raise

    def _bucket_device(self, ipc: list[int], group: DataPlaneGroup | None) -> torch.device:
        if self._device is not None:
            return self._device
        if ipc:
            return torch.device("cuda", torch.cuda.current_device())
        return group.device if group is not None else torch.device("cpu")

    def _packed(self, source: Iterable[tuple[str, torch.Tensor]] | StagedWeights, ipc: list[int],
                group: DataPlaneGroup | None) -> Iterator[PackedBucket]:
        """The buckets to send: staged ones (once their packing copies are done, in stream
        order), or packed one at a time, each while the previous one is in flight."""
        if isinstance(source, StagedWeights):
            if source.ready is not None and source.buckets:
                torch.cuda.current_stream(source.buckets[0][1].device).wait_event(source.ready)
            return iter(source.buckets)
        device = self._bucket_device(ipc, group)
        return (pack(bucket, device) for bucket in buckets(source, self.cfg.bucket_bytes))

    def _stream_buckets(self, packed: Iterator[PackedBucket], state: dict, ipc: list[int],
                        group: DataPlaneGroup | None) -> tuple[int, int]:
        offer, attempt, n, total, pending = state["offer"], state["attempt"], 0, 0, None
        for entries, buf in packed:
            handle = share(buf) if ipc else None  # after the packing copies are enqueued
            if pending is not None:
                pending()
            header = {"last": False, "size": buf.numel(), "entries": [e.__dict__ for e in entries], "ipc": handle}
            self._store.set(SyncKeys.bucket(offer, self.stage, attempt, n), json.dumps(header))
            n, total = n + 1, total + sum(e.nbytes for e in entries)
            state["n"] = n
            waits = []
            if group is not None:
                waits.append(group.broadcast_async(buf, 0, f"v{state['version']} stage {self.stage} bucket {n - 1}",
                                                   given_up=partial(self._left, offer, attempt, state["bcast"])))
            if ipc:
                waits.append(lambda index=n - 1: self._await_done(offer, attempt, index, ipc))
            pending = lambda waits=waits, keep=buf: [w() for w in waits]  # noqa: E731 - buf lives until done
        if pending is not None:
            pending()
        if n == 0:  # a source already consumed: the members would hold their old weights as this version
            raise TransportTimeout(f"weight sync v{state['version']} stage {self.stage} round {attempt}: "
                                   f"the source yielded no tensor (a one-shot export already sent)")
        self._store.set(SyncKeys.bucket(offer, self.stage, attempt, n), json.dumps({"last": True}))
        return n, total

    def _left(self, offer: int, attempt: int, members: list[int]) -> str | None:
        """Why a broadcast member of this attempt will not take the rest of it, or None: it posted
        its failure (it walked away: its end of the group is no longer read) or it is gone."""
        self._hb.refresh(self._store)
        gone = [w for w in members if self._outcome(offer, attempt, w) is False]
        return f"{self._failure(offer, gone[0])} (it left this attempt)" if gone else None

    def _await_done(self, offer: int, attempt: int, index: int, ipc: list[int]) -> None:
        """Wait until every IPC member read bucket ``index``; a lost or failed one ends the attempt."""
        deadline = time.monotonic() + self.cfg.collective_timeout_s
        for w in ipc:
            key = SyncKeys.done(offer, self.stage, attempt, index, w)
            while True:
                try:
                    wait_key(self._store, key, 1.0, "IPC done")
                    break
                except TransportTimeout:
                    self._hb.refresh(self._store)
                    if self._dead(w) or self._gave_up(offer, w) or time.monotonic() > deadline:
                        raise TransportTimeout(f"weight sync offer {offer} stage {self.stage} bucket {index}: "
                                               f"{self._failure(offer, w)}") from None


def _proc(ready_info: dict) -> Proc | None:
    """The process (host, pid) a "ready" record names (None for a record without one)."""
    if "pid" not in ready_info:
        return None
    return str(ready_info.get("host", "")), int(ready_info["pid"])


class _Acks:
    """Stage 0's acks of one publish: polled between rounds (the published version moves to a
    version as soon as one worker acked it), awaited for everyone at the end."""

    def __init__(self, sender: WeightSender, offer: int, report: SyncReport) -> None:
        self._sender, self._offer, self._report = sender, offer, report
        self._pending: dict[int, int] = {}  # worker -> version sent to it, not acked yet

    def expect(self, workers: list[int], sent: int) -> None:
        self._pending.update({w: sent for w in workers})
        self.poll()

    def poll(self) -> None:
        store, report = self._sender._store, self._report
        for w, sent in list(self._pending.items()):
            if get_int(store, SyncKeys.ack(w), -1) >= sent:
                del self._pending[w]
                report.acked = sorted(set(report.acked) | {w})
                publish_version(store, sent)
                report.published = True
            elif self._sender._dead(w) or self._sender._gave_up(self._offer, w):
                del self._pending[w]
                report.missing.append(self._sender._failure(self._offer, w))

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(self._sender._control.poll_interval_s)
            self._sender._hb.refresh(self._sender._store)
            self.poll()
        if self._pending:
            names = [describe_peer(self._sender._store, WORKER, w) for w in self._pending]
            log.error("weight sync v%d: no ack after %.0f s from %s; they sit out until the next sync",
                      self._report.version, timeout_s, "; ".join(names))
            self._report.missing += names
