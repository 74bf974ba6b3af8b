"""Weight sync: each trainer PP-stage leader sends HF-named full tensors to every rollout worker.

Protocol for version v (store keys under ``ws/``), per stage s, no disk, no pickles:

1. the stage-s leader offers v; each live worker, at its next safe point (between generation
   steps), sees stage 0's offer and posts "ready for v" once, for all stages, with the UUID of
   its GPU; it then takes the stages in order (a later stage's leader waits meanwhile);
2. the leader waits for every live worker (heartbeat) to be ready, at most ``join_timeout_s``,
   names the missing ones, and posts a plan: the members, which of them share the leader's GPU
   (``ipc``), the backend and a group epoch for the others. The data-plane group {leader s} +
   broadcast members is rebuilt only when they change (a dead worker never blocks a later sync;
   a stalled one delays a sync by at most ``join_timeout_s``). Backend ``auto`` is NCCL when the
   leader and every broadcast member hold distinct GPUs, else gloo (NCCL refuses two ranks on
   one device);
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
stay under the offered version (the round).

Failures are loud (DESIGN.md section 3): a worker whose engine cannot load the weights posts
why and exits (``WeightLoadError``); a sync that no ready worker could take raises
``WeightSyncFailed`` on the leader with each worker's reason, so the trainer checkpoints and
stops instead of training on while every worker waits for weights that never come.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_darl.transport.buckets import BucketEntry, buckets, pack
from megatron_darl.transport.config import ControlPlaneConfig, WeightSyncConfig
from megatron_darl.transport.cuda_ipc import device_uuid, share
from megatron_darl.transport.heartbeat import Heartbeat
from megatron_darl.transport.process_group import DataPlaneGroup, build_group
from megatron_darl.transport.store import (
    WORKER, ControlStore, Keys, TransportTimeout, describe_peer, get_int, published_version, wait_key,
)

log = logging.getLogger(__name__)
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Callable[[], Iterable[tuple[str, torch.Tensor]]]
PackedBucket = tuple[list[BucketEntry], torch.Tensor]  # entries and their flat uint8 buffer


class SyncKeys:
    """Store keys of the weight-sync handshake."""

    @staticmethod
    def offer(stage: int) -> str:
        return f"ws/offer/{stage}"

    @staticmethod
    def ready(version: int, worker: int) -> str:
        return f"ws/{version}/ready/{worker}"

    @staticmethod
    def failed(version: int, worker: int) -> str:
        return f"ws/{version}/failed/{worker}"

    @staticmethod
    def retry_ready(version: int, stage: int, attempt: int, worker: int) -> str:
        return f"ws/{version}/{stage}/{attempt}/ready/{worker}"

    @staticmethod
    def result(version: int, stage: int, attempt: int, worker: int) -> str:
        """"1": the worker loaded every bucket of this attempt; "0": it did not."""
        return f"ws/{version}/{stage}/{attempt}/result/{worker}"

    @staticmethod
    def plan(version: int, stage: int, attempt: int) -> str:
        return f"ws/{version}/{stage}/{attempt}/plan"

    @staticmethod
    def verdict(version: int, stage: int, attempt: int) -> str:
        """"1": the leader retries with attempt + 1; "0": this attempt was the last."""
        return f"ws/{version}/{stage}/{attempt}/verdict"

    @staticmethod
    def bucket(version: int, stage: int, attempt: int, index: int) -> str:
        return f"ws/{version}/{stage}/{attempt}/bucket/{index}"

    @staticmethod
    def done(version: int, stage: int, attempt: int, index: int, worker: int) -> str:
        """A worker on the leader's GPU finished reading bucket ``index`` through its IPC handle."""
        return f"ws/{version}/{stage}/{attempt}/done/{index}/{worker}"

    @staticmethod
    def ack(worker: int) -> str:
        return f"ws/ack/{worker}"


@dataclass
class SyncReport:
    """What one ``publish`` did on one stage leader."""

    version: int  # version offered
    stage: int  # PP stage of this leader
    members: list[int]  # workers the stage reached
    missing: list[str] = field(default_factory=list)  # live workers left out (not ready/failed)
    acked: list[int] = field(default_factory=list)  # coordinator only: workers that acked
    published: bool = False  # coordinator only: the published version moved to ``version``
    attempts: int = 1  # attempts used (> 1: a member failed mid-broadcast and was dropped)
    buckets: int = 0  # buckets sent
    bytes: int = 0  # payload bytes sent
    seconds: float = 0.0  # wall time of publish
    wait_seconds: float = 0.0  # of which waiting for the workers' safe points (their "ready")
    ipc: list[int] = field(default_factory=list)  # members reached by CUDA IPC (on the leader's GPU)


@dataclass
class StagedWeights:
    """One version of a stage's weights packed into bucket buffers ahead of its publish."""

    version: int  # the trainer version they are
    buckets: list[PackedBucket]  # every bucket, packed
    ready: torch.cuda.Event | None  # recorded after the packing copies (CUDA), else None
    nbytes: int  # payload bytes


class WeightSyncFailed(RuntimeError):
    """No rollout worker could take a version (each one's reason in the message): the run
    cannot go on, since workers would generate from weights the trainer left behind."""


class WeightLoadError(RuntimeError):
    """This worker's engine could not load the weights it received (wrong model, out of memory):
    nothing later can fix that, so the worker reports it and exits."""


class WeightSender:
    """One trainer PP-stage leader's end of weight sync.

    Args:
        stage: this leader's PP stage; stage 0 is the coordinator that moves the published version.
        heartbeat: the trainer's heartbeat, which watches the workers (who is live).
        device: where buckets are packed (the leader's GPU; None: the group's device, or the
            current CUDA device when a worker shares it).
    """

    def __init__(
        self, store: ControlStore, control: ControlPlaneConfig, cfg: WeightSyncConfig, stage: int,
        heartbeat: Heartbeat, device: torch.device | None = None,
    ) -> None:
        if not 0 <= stage < control.num_stages:
            raise ValueError(f"stage {stage} outside 0..{control.num_stages - 1}")
        self._store, self._control, self.cfg, self.stage = store, control, cfg, stage
        self._hb = heartbeat
        for w in range(control.num_workers):
            heartbeat.watch(WORKER, w)
        heartbeat.refresh(store)
        self._group: DataPlaneGroup | None = None
        self._members: list[int] = []  # broadcast members of ``_group``
        self._epoch = 0  # store prefix counter of this stage's groups
        self._last_version = -1
        self._device = device
        self._gpu = device_uuid(device)  # "" on CPU: no worker can share it
        self._host = socket.gethostname()
        self._path = ""  # how the last sync reached its members (logged when it changes)

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
                upgrade: Callable[[], StagedWeights] | None = None) -> SyncReport:
        """Send this stage's HF-named full tensors as ``version``; stage 0 also waits for acks.

        ``named_tensors`` is a list, ``StagedWeights``, or a zero-argument callable returning a
        fresh iterator (the trainer's export); each lets a failed attempt (a worker died
        mid-broadcast) be retried with the survivors, up to ``max_attempts``. A one-shot iterator
        gets one attempt. ``upgrade``, once every worker is ready, gives the newest staged weights
        (of at least ``version``), which are sent instead: the report's ``version`` is the one sent.
        Raises ``WeightSyncFailed`` when every worker that took part failed, or (stage 0) none
        loaded the version; with no worker ready within ``join_timeout_s`` the version is not
        published and the report names the ones left out.
        """
        start = time.monotonic()
        self._drop_group_if_a_member_failed()
        self._store.set(SyncKeys.offer(self.stage), str(version))
        report = SyncReport(version=version, stage=self.stage, members=[])
        retriable = callable(named_tensors) or isinstance(named_tensors, (list, tuple, StagedWeights))
        redo: list[int] | None = None  # attempt > 0: the live members whose attempt failed
        tried: set[int] = set()
        for attempt in range(self.cfg.max_attempts):
            waited = time.monotonic()
            members, missing = self._gather_ready(version, attempt, redo)
            report.wait_seconds += time.monotonic() - waited
            if attempt == 0 and upgrade is not None and members:
                named_tensors = upgrade()
                report.version = named_tensors.version
            tried |= set(members)
            report.attempts = attempt + 1
            report.missing += missing
            source = named_tensors() if callable(named_tensors) else named_tensors
            failed = self._attempt(version, attempt, members, source, report)
            report.members = sorted(set(report.members) | (set(members) - set(failed)))
            redo = [w for w in failed if not self._hb.is_lost(WORKER, w) and not self._gave_up(version, w)]
            report.missing += [self._failure(version, w) for w in failed if w not in redo]
            last = not redo or not retriable or attempt + 1 == self.cfg.max_attempts
            self._store.set(SyncKeys.verdict(version, self.stage, attempt), "0" if last else "1")
            if last:
                break
        self._last_version = version
        if tried and not report.members:
            reasons = "; ".join(self._failure(version, w) for w in sorted(tried))
            raise WeightSyncFailed(f"weight sync v{version} stage {self.stage} failed for every rollout "
                                   f"worker: {reasons}")
        if self.stage == 0:
            self._await_acks(report.version, report.members, report)
        report.seconds = time.monotonic() - start
        return report

    # ---- one attempt --------------------------------------------------------------------------
    def _attempt(self, version: int, attempt: int, members: list[int],
                 source: Iterable[tuple[str, torch.Tensor]] | StagedWeights, report: SyncReport) -> list[int]:
        """One pass of the stage to ``members``; returns the members it failed for."""
        ipc = [w for w in members if self._shares_gpu(version, w)]
        bcast = [w for w in members if w not in ipc]
        backend = self._backend(version, bcast)
        reuse = (attempt == 0 and self._group is not None and bcast == self._members
                 and self._group.backend == backend)
        if bcast and not reuse:
            self._epoch += 1
        plan = {"epoch": self._epoch, "members": members, "ipc": ipc, "backend": backend,
                "version": report.version}
        self._store.set(SyncKeys.plan(version, self.stage, attempt), json.dumps(plan))
        report.ipc = ipc
        path = f"CUDA IPC to {ipc}, {backend} broadcast to {bcast}" if ipc and bcast else (
            f"CUDA IPC to {ipc}" if ipc else f"{backend} broadcast to {bcast}")
        if members and path != self._path:
            log.info("weight sync stage %d: %s", self.stage, path)
            self._path = path
        if not members:
            return []
        try:
            if not bcast:
                self._group, self._members = None, []
            elif not reuse:
                self._group, self._members = None, []
                self._group = build_group(self._store, f"ws/{self.stage}/{self._epoch}", 0, len(bcast) + 1,
                                          backend, self.cfg.collective_timeout_s)
                self._members = bcast
            report.buckets, report.bytes = self._stream(version, attempt, source, ipc)
        except TransportTimeout as exc:
            log.error("weight sync v%d stage %d attempt %d failed, members %s: %s",
                      version, self.stage, attempt, members, exc)
        failed = self._member_results(version, attempt, members)
        if set(failed) & set(bcast):  # a member died or failed: its end of the group is gone
            self._group, self._members = None, []
        return failed

    def _ready_info(self, version: int, worker: int) -> dict:
        """What a worker posted with "ready": its GPU UUID and host."""
        try:
            info = json.loads(self._store.get(SyncKeys.ready(version, worker)))
        except (ValueError, RuntimeError, dist.DistError):
            return {}
        return info if isinstance(info, dict) else {}

    def _shares_gpu(self, version: int, worker: int) -> bool:
        """The worker sits on this leader's GPU (same host, same device UUID) and IPC is on."""
        if self.cfg.colocated != "ipc" or not self._gpu:
            return False
        info = self._ready_info(version, worker)
        return info.get("gpu") == self._gpu and info.get("host") == self._host

    def _backend(self, version: int, bcast: list[int]) -> str:
        """The configured backend, or for ``auto`` NCCL when every member holds its own GPU."""
        if self.cfg.backend != "auto":
            return self.cfg.backend
        gpus = [self._ready_info(version, w).get("gpu", "") for w in bcast]
        distinct = len(set(gpus) | {self._gpu}) == len(gpus) + 1
        return "nccl" if self._gpu and all(gpus) and distinct else "gloo"

    def _member_results(self, version: int, attempt: int, members: list[int]) -> list[int]:
        """Members that did not load this attempt (reported failure, lost, or silent past the timeout)."""
        deadline = time.monotonic() + self.cfg.collective_timeout_s
        results: dict[int, bool] = {}
        while len(results) < len(members) and time.monotonic() < deadline:
            self._hb.refresh(self._store)
            for w in members:
                key = SyncKeys.result(version, self.stage, attempt, w)
                if w not in results and self._store.check([key]):
                    results[w] = self._store.get(key) == b"1"
                elif w not in results and (self._hb.is_lost(WORKER, w) or self._gave_up(version, w)):
                    results[w] = False
            time.sleep(self._control.poll_interval_s)
        return [w for w in members if not results.get(w, False)]

    def _gave_up(self, version: int, worker: int) -> bool:
        """The worker posted that it failed this version (e.g. its engine could not load it)."""
        return bool(self._store.check([SyncKeys.failed(version, worker)]))

    def _failure(self, version: int, worker: int) -> str:
        """Why ``worker`` did not take ``version``, naming it (role, rank, host, pid)."""
        key = SyncKeys.failed(version, worker)
        if self._store.check([key]):
            reason = self._store.get(key).decode(errors="replace")
            if reason != "1":
                return reason
        peer = describe_peer(self._store, WORKER, worker)
        if self._hb.is_lost(WORKER, worker):
            return f"{peer}: lost (no heartbeat)"
        return f"{peer}: did not receive the weights (see its log)"

    def _drop_group_if_a_member_failed(self) -> None:
        """A member that failed the last sync may have dropped its end of the group: rebuild."""
        if self._group is None or self._last_version < 0:
            return
        if any(self._gave_up(self._last_version, w) for w in self._members):
            self._group, self._members = None, []

    def _live_workers(self) -> list[int]:
        self._hb.refresh(self._store)
        return [w for w in range(self._control.num_workers) if self._hb.is_alive(WORKER, w)]

    def _gather_ready(self, version: int, attempt: int, redo: list[int] | None) -> tuple[list[int], list[str]]:
        """Wait for every live worker's safe point (on a retry: those in ``redo``); after
        ``join_timeout_s`` go on with the ready ones, if any. A worker stuck before its safe point
        is not the sync's to judge: the loop's progress watch names it if it never comes back."""
        start = time.monotonic()
        while True:
            live = [w for w in self._live_workers() if redo is None or w in redo]
            ready = [w for w in range(self._control.num_workers) if self._store.check([
                SyncKeys.ready(version, w) if attempt == 0 else SyncKeys.retry_ready(version, self.stage, attempt, w)])]
            waiting = [w for w in live if w not in ready]
            if not waiting or time.monotonic() - start > self.cfg.join_timeout_s:
                break
            time.sleep(self._control.poll_interval_s)
        missing = [describe_peer(self._store, WORKER, w) for w in waiting]
        if missing:
            log.error("weight sync v%d stage %d: not ready after %.1f s, left out until the next sync: %s",
                      version, self.stage, self.cfg.join_timeout_s, "; ".join(missing))
        return sorted(ready), missing

    # ---- streaming ----------------------------------------------------------------------------
    def _stream(self, version: int, attempt: int, source: Iterable[tuple[str, torch.Tensor]] | StagedWeights,
                ipc: list[int]) -> tuple[int, int]:
        state = {"n": 0, "attempt": attempt}
        try:
            return self._stream_buckets(version, self._packed(source, ipc), state, ipc)
        except TransportTimeout:
            key = SyncKeys.bucket(version, self.stage, attempt, state["n"])
            self._store.set(key, json.dumps({"last": True, "aborted": True}))
            raise

    def _bucket_device(self, ipc: list[int]) -> torch.device:
        if self._device is not None:
            return self._device
        if ipc:
            return torch.device("cuda", torch.cuda.current_device())
        return self._group.device if self._group is not None else torch.device("cpu")

    def _packed(self, source: Iterable[tuple[str, torch.Tensor]] | StagedWeights,
                ipc: list[int]) -> Iterator[PackedBucket]:
        """The buckets to send: staged ones (once their packing copies are done, in stream
        order), or packed one at a time, each while the previous one is in flight."""
        if isinstance(source, StagedWeights):
            if source.ready is not None and source.buckets:
                torch.cuda.current_stream(source.buckets[0][1].device).wait_event(source.ready)
            return iter(source.buckets)
        device = self._bucket_device(ipc)
        return (pack(bucket, device) for bucket in buckets(source, self.cfg.bucket_bytes))

    def _stream_buckets(self, version: int, packed: Iterator[PackedBucket], state: dict,
                        ipc: list[int]) -> tuple[int, int]:
        group, n, total, pending = self._group, 0, 0, None
        for entries, buf in packed:
            handle = share(buf) if ipc else None  # after the packing copies are enqueued
            if pending is not None:
                pending()
            header = {"last": False, "size": buf.numel(), "entries": [e.__dict__ for e in entries], "ipc": handle}
            self._store.set(SyncKeys.bucket(version, self.stage, state["attempt"], n), json.dumps(header))
            n, total = n + 1, total + sum(e.nbytes for e in entries)
            state["n"] = n
            waits = []
            if group is not None:
                waits.append(group.broadcast_async(buf, 0, f"v{version} stage {self.stage} bucket {n - 1}"))
            if ipc:
                index = n - 1
                waits.append(lambda index=index: self._await_done(version, state["attempt"], index, ipc))
            pending = lambda waits=waits, keep=buf: [w() for w in waits]  # noqa: E731 - buf lives until done
        if pending is not None:
            pending()
        self._store.set(SyncKeys.bucket(version, self.stage, state["attempt"], n), json.dumps({"last": True}))
        return n, total

    def _await_done(self, version: int, attempt: int, index: int, ipc: list[int]) -> None:
        """Wait until every IPC member read bucket ``index``; a lost or failed one ends the attempt."""
        deadline = time.monotonic() + self.cfg.collective_timeout_s
        for w in ipc:
            key = SyncKeys.done(version, self.stage, attempt, index, w)
            while True:
                try:
                    wait_key(self._store, key, 1.0, "IPC done")
                    break
                except TransportTimeout:
                    self._hb.refresh(self._store)
                    if self._hb.is_lost(WORKER, w) or self._gave_up(version, w) or time.monotonic() > deadline:
                        raise TransportTimeout(f"weight sync v{version} stage {self.stage} bucket {index}: "
                                               f"{self._failure(version, w)}") from None

    def _await_acks(self, version: int, members: list[int], report: SyncReport) -> None:
        deadline = time.monotonic() + self.cfg.ack_timeout_s
        waiting = list(members)
        while waiting and time.monotonic() < deadline:
            acked = [w for w in waiting if get_int(self._store, SyncKeys.ack(w), -1) >= version]
            report.acked += acked
            dead = [w for w in waiting if w not in acked and (
                self._hb.is_lost(WORKER, w) or self._gave_up(version, w))]
            for w in dead:
                report.missing.append(self._failure(version, w))
            waiting = [w for w in waiting if w not in acked and w not in dead]
            if waiting:
                time.sleep(self._control.poll_interval_s)
        if waiting:
            names = [describe_peer(self._store, WORKER, w) for w in waiting]
            log.error("weight sync v%d: no ack after %.0f s from %s; they sit out until the next sync",
                      version, self.cfg.ack_timeout_s, "; ".join(names))
            report.missing += names
        if not members:
            log.error("weight sync v%d: no live rollout worker took part; published version stays", version)
            return
        if not report.acked:
            raise WeightSyncFailed(f"weight sync v{version}: no rollout worker loaded it: {'; '.join(report.missing)}")
        if version > published_version(self._store) or not self._store.check([Keys.PUBLISHED]):
            self._store.set(Keys.PUBLISHED, str(version))
        report.published = True
