"""Weight sync: each trainer PP-stage leader broadcasts HF-named full tensors to all rollout workers.

Protocol for version v (store keys under ``ws/``), per stage s, no disk, no pickles:

1. the stage-s leader offers v; each live worker, at its next safe point (between generation
   steps), sees stage 0's offer and posts "ready for v" once, for all stages; it then takes the
   stages in order (a later stage's leader waits in group construction meanwhile);
2. the leader waits for every live worker (heartbeat) to be ready, at most ``join_timeout_s``,
   names the missing ones, and posts a plan: the member list and a group epoch. The data-plane
   group {leader s} + members is rebuilt only when the members change (a dead worker never
   blocks a later sync; a stalled one delays a sync by at most ``join_timeout_s``);
3. the leader streams buckets of ~``bucket_bytes``: a small JSON header per bucket in the store
   (names, dtypes, shapes, byte offsets) and one flat uint8 tensor broadcast over the group
   (dtype-agnostic, one collective per bucket; each tensor 16-byte aligned, viewed back in place on
   the receiver); the next bucket is packed while the previous one is in flight;
4. each worker loads every bucket in place (``Engine.load_weights``) and, once all stages are in,
   acks v; the coordinator (stage 0 leader) moves the published version to v when every live
   member acked (dead ones are reported by name and dropped) and at least one did (a sync that
   reached no worker leaves the published version where it was). A worker that missed the sync
   keeps its old weights but generates nothing while they are older than the published version;
   one that missed only some stages holds no valid version until the next sync.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_darl.transport.config import ControlPlaneConfig, WeightSyncConfig
from megatron_darl.transport.heartbeat import Heartbeat
from megatron_darl.transport.process_group import DataPlaneGroup, build_group
from megatron_darl.transport.store import (
    WORKER, ControlStore, Keys, TransportTimeout, describe_peer, get_int, published_version, wait_key,
)

log = logging.getLogger(__name__)
_ALIGN = 16
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Callable[[], Iterable[tuple[str, torch.Tensor]]]


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
    def ack(worker: int) -> str:
        return f"ws/ack/{worker}"


@dataclass
class BucketEntry:
    """Where one tensor sits in a bucket's byte buffer."""

    name: str  # HF parameter name
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: list[int]  # full tensor shape
    offset: int  # byte offset in the bucket buffer (16-byte aligned)
    nbytes: int  # bytes of the tensor


@dataclass
class SyncReport:
    """What one ``publish`` did on one stage leader."""

    version: int  # version offered
    stage: int  # PP stage of this leader
    members: list[int]  # workers the stage was broadcast to
    missing: list[str] = field(default_factory=list)  # live workers left out (not ready/failed)
    acked: list[int] = field(default_factory=list)  # coordinator only: workers that acked
    published: bool = False  # coordinator only: the published version moved to ``version``
    attempts: int = 1  # attempts used (> 1: a member failed mid-broadcast and was dropped)
    buckets: int = 0  # buckets broadcast
    bytes: int = 0  # payload bytes broadcast
    seconds: float = 0.0  # wall time of publish


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight bucket header")
    return dtype


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    if bucket:
        yield bucket


def _pack(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[list[BucketEntry], torch.Tensor]:
    entries, off = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        entries.append(BucketEntry(name, str(t.dtype).removeprefix("torch."), list(t.shape), off, nbytes))
        off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    buf = torch.empty(max(off, 1), dtype=torch.uint8, device=device)
    for e, (_, t) in zip(entries, bucket):
        if e.nbytes:
            buf[e.offset : e.offset + e.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return entries, buf


def _unpack(entries: list[BucketEntry], buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [
        (e.name, buf[e.offset : e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)) for e in entries
    ]


class WeightSender:
    """One trainer PP-stage leader's end of weight sync.

    Args:
        stage: this leader's PP stage; stage 0 is the coordinator that moves the published version.
        heartbeat: the trainer's heartbeat, which watches the workers (who is live).
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
        self._members: list[int] = []
        self._epoch = 0  # store prefix counter of this stage's groups
        self._last_version = -1
        self._device = device

    def publish(self, version: int, named_tensors: NamedTensors) -> SyncReport:
        """Broadcast this stage's HF-named full tensors as ``version``; stage 0 also waits for acks.

        ``named_tensors`` is a list, or a zero-argument callable returning a fresh iterator (the
        trainer's export); either lets a failed attempt (a worker died mid-broadcast) be retried
        with the survivors, up to ``max_attempts``. A one-shot iterator gets one attempt.
        Raises ``TransportTimeout`` when live workers exist but none became ready within
        ``join_timeout_s + collective_timeout_s``, or (stage 0) when no worker loaded the version.
        """
        start = time.monotonic()
        self._drop_group_if_a_member_failed()
        self._store.set(SyncKeys.offer(self.stage), str(version))
        report = SyncReport(version=version, stage=self.stage, members=[])
        retriable = callable(named_tensors) or isinstance(named_tensors, (list, tuple))
        redo: list[int] | None = None  # attempt > 0: the live members whose attempt failed
        for attempt in range(self.cfg.max_attempts):
            members, missing = self._gather_ready(version, attempt, redo)
            report.attempts = attempt + 1
            report.missing += missing
            source = named_tensors() if callable(named_tensors) else named_tensors
            failed = self._attempt(version, attempt, members, source, report)
            report.members = sorted(set(report.members) | (set(members) - set(failed)))
            redo = [w for w in failed if not self._hb.is_lost(WORKER, w)]
            report.missing += [describe_peer(self._store, WORKER, w) for w in failed if w not in redo]
            last = not redo or not retriable or attempt + 1 == self.cfg.max_attempts
            self._store.set(SyncKeys.verdict(version, self.stage, attempt), "0" if last else "1")
            if last:
                break
        self._last_version = version
        if self.stage == 0:
            self._await_acks(version, report.members, report)
        report.seconds = time.monotonic() - start
        return report

    def _attempt(self, version: int, attempt: int, members: list[int], source: Iterable[tuple[str, torch.Tensor]],
                 report: SyncReport) -> list[int]:
        """One broadcast of the stage to ``members``; returns the members it failed for."""
        reuse = attempt == 0 and self._group is not None and members == self._members
        if not reuse:
            self._epoch += 1
        plan = {"epoch": self._epoch, "members": members}
        self._store.set(SyncKeys.plan(version, self.stage, attempt), json.dumps(plan))
        if not members:
            return []
        try:
            if not reuse:
                self._group, self._members = None, []
                self._group = build_group(self._store, f"ws/{self.stage}/{self._epoch}", 0, len(members) + 1,
                                          self.cfg.backend, self.cfg.collective_timeout_s)
                self._members = members
            report.buckets, report.bytes = self._stream(version, attempt, source)
        except TransportTimeout as exc:
            log.error("weight sync v%d stage %d attempt %d failed, members %s: %s",
                      version, self.stage, attempt, members, exc)
        failed = self._member_results(version, attempt, members)
        if failed:  # a member died or failed: its end of the group is gone, rebuild next time
            self._group, self._members = None, []
        return failed

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
                elif w not in results and self._hb.is_lost(WORKER, w):
                    results[w] = False
            time.sleep(self._control.poll_interval_s)
        return [w for w in members if not results.get(w, False)]

    def _drop_group_if_a_member_failed(self) -> None:
        """A member that failed the last sync may have dropped its end of the group: rebuild."""
        if self._group is None or self._last_version < 0:
            return
        if any(self._store.check([SyncKeys.failed(self._last_version, w)]) for w in self._members):
            self._group, self._members = None, []

    def _live_workers(self) -> list[int]:
        self._hb.refresh(self._store)
        return [w for w in range(self._control.num_workers) if self._hb.is_alive(WORKER, w)]

    def _gather_ready(self, version: int, attempt: int, redo: list[int] | None) -> tuple[list[int], list[str]]:
        """Wait for every live worker's safe point (on a retry: those in ``redo``); after
        ``join_timeout_s`` go on with the ready ones."""
        start = time.monotonic()
        while True:
            live = [w for w in self._live_workers() if redo is None or w in redo]
            ready = [w for w in range(self._control.num_workers) if self._store.check([
                SyncKeys.ready(version, w) if attempt == 0 else SyncKeys.retry_ready(version, self.stage, attempt, w)])]
            waiting = [w for w in live if w not in ready]
            waited = time.monotonic() - start
            if not waiting or ((ready or attempt > 0) and waited > self.cfg.join_timeout_s):
                break
            if waited > self.cfg.join_timeout_s + self.cfg.collective_timeout_s:
                names = "; ".join(describe_peer(self._store, WORKER, w) for w in waiting)
                raise TransportTimeout(f"weight sync v{version} stage {self.stage}: no live worker reached a "
                                       f"safe point in {waited:.0f} s: {names}")
            time.sleep(self._control.poll_interval_s)
        missing = [describe_peer(self._store, WORKER, w) for w in waiting]
        if missing:
            log.error("weight sync v%d stage %d: not ready after %.1f s, left out until the next sync: %s",
                      version, self.stage, self.cfg.join_timeout_s, "; ".join(missing))
        return sorted(ready), missing

    def _stream(self, version: int, attempt: int, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        state = {"n": 0, "attempt": attempt}
        try:
            return self._stream_buckets(version, named, state)
        except TransportTimeout:
            key = SyncKeys.bucket(version, self.stage, attempt, state["n"])
            self._store.set(key, json.dumps({"last": True, "aborted": True}))
            raise

    def _stream_buckets(self, version: int, named: Iterable[tuple[str, torch.Tensor]], state: dict) -> tuple[int, int]:
        group, n, total, pending = self._group, 0, 0, None
        device = self._device or group.device
        for bucket in _buckets(named, self.cfg.bucket_bytes):
            entries, buf = _pack(bucket, device)
            if pending is not None:
                pending()
            header = {"last": False, "size": buf.numel(), "entries": [e.__dict__ for e in entries]}
            self._store.set(SyncKeys.bucket(version, self.stage, state["attempt"], n), json.dumps(header))
            n, total = n + 1, total + sum(e.nbytes for e in entries)
            state["n"] = n
            wait = group.broadcast_async(buf, 0, f"v{version} stage {self.stage} bucket {n - 1}")
            pending = lambda wait=wait, keep=buf: (wait(), keep)  # noqa: E731 - buf lives until its wait
        if pending is not None:
            pending()
        self._store.set(SyncKeys.bucket(version, self.stage, state["attempt"], n), json.dumps({"last": True}))
        return n, total

    def _await_acks(self, version: int, members: list[int], report: SyncReport) -> None:
        deadline = time.monotonic() + self.cfg.ack_timeout_s
        waiting = list(members)
        while waiting and time.monotonic() < deadline:
            acked = [w for w in waiting if get_int(self._store, SyncKeys.ack(w), -1) >= version]
            report.acked += acked
            dead = [w for w in waiting if w not in acked and (
                self._hb.is_lost(WORKER, w) or self._store.check([SyncKeys.failed(version, w)]))]
            for w in dead:
                report.missing.append(describe_peer(self._store, WORKER, w))
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
            raise TransportTimeout(f"weight sync v{version}: no rollout worker loaded it ({'; '.join(report.missing)})")
        if version > published_version(self._store) or not self._store.check([Keys.PUBLISHED]):
            self._store.set(Keys.PUBLISHED, str(version))
        report.published = True


class WeightReceiver:
    """A rollout worker's end of weight sync; call ``maybe_sync`` at safe points.

    Args:
        load: ``Engine.load_weights``, called once per bucket with views into the received buffer.
        initial_version: version of the weights the engine starts with (0: the same checkpoint the
            trainer starts from), or -1 when the engine must wait for a first sync.
    """

    def __init__(
        self, store: ControlStore, control: ControlPlaneConfig, cfg: WeightSyncConfig, worker_id: int,
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], None], initial_version: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self._store, self._control, self.cfg, self.worker_id = store, control, cfg, worker_id
        self._load, self._device = load, device
        self.version = initial_version  # weights the engine holds now; -1 = none valid
        self._attempted = max(initial_version, get_int(store, SyncKeys.ack(worker_id), -1))
        self._groups: dict[int, tuple[int, DataPlaneGroup]] = {}  # stage -> (epoch, group)
        self._loaded_any = False  # a bucket of the sync in progress reached the engine

    def pending(self) -> int | None:
        """Version offered by stage 0 and not yet attempted, or None."""
        v = get_int(self._store, SyncKeys.offer(0), -1)
        return v if v > self._attempted else None

    def can_generate(self) -> bool:
        """True while the engine holds at least the published version (DESIGN.md section 3)."""
        return self.version >= 0 and self.version >= published_version(self._store)

    def maybe_sync(self) -> int | None:
        """Take part in an offered sync, if any; returns the new version when it was loaded."""
        version = self.pending()
        if version is None:
            return None
        self._attempted = version
        self._store.set(SyncKeys.ready(version, self.worker_id), "1")  # for every stage at once
        self._loaded_any = False
        ok = True
        for stage in range(self._control.num_stages):
            ok = self._receive_stage(version, stage) and ok
        if not ok:
            if self._loaded_any:  # weights of two versions mixed: none is valid until the next sync
                self.version = -1
            self._store.set(SyncKeys.failed(version, self.worker_id), "1")
            log.error("rollout %d: missed sync of v%d (engine keeps v%d); waiting for the next",
                      self.worker_id, version, self.version)
            return None
        if torch.cuda.is_available() and any(g.backend == "nccl" for _, g in self._groups.values()):
            torch.cuda.synchronize()  # the copies into the engine are done before we ack
        self.version = version
        self._store.set(SyncKeys.ack(self.worker_id), str(version))
        return version

    def _receive_stage(self, version: int, stage: int) -> bool:
        """Receive one stage, following the leader's retries after a failed attempt."""
        attempt = 0
        while True:
            ok = self._receive_attempt(version, stage, attempt)
            self._store.set(SyncKeys.result(version, stage, attempt, self.worker_id), "1" if ok else "0")
            if ok:
                return True
            key = SyncKeys.verdict(version, stage, attempt)
            try:
                wait_key(self._store, key, self.cfg.join_timeout_s + self.cfg.collective_timeout_s,
                         f"rollout {self.worker_id}, sync v{version} stage {stage}: verdict on attempt {attempt}")
            except TransportTimeout as exc:
                log.error("%s", exc)
                return False
            if self._store.get(key) != b"1":
                return False
            attempt += 1
            self._store.set(SyncKeys.retry_ready(version, stage, attempt, self.worker_id), "1")

    def _receive_attempt(self, version: int, stage: int, attempt: int) -> bool:
        what = f"rollout {self.worker_id}, sync v{version} stage {stage} attempt {attempt}"
        try:
            key = SyncKeys.plan(version, stage, attempt)
            wait_key(self._store, key, self.cfg.join_timeout_s + self.cfg.collective_timeout_s,
                     f"{what}: plan of the stage leader")
            plan = json.loads(self._store.get(key))
            if self.worker_id not in plan["members"]:
                log.error("%s: left out of the plan (late)", what)
                return False
            group = self._group(stage, plan["epoch"], plan["members"])
            self._receive_buckets(version, stage, attempt, group, what)
            return True
        except TransportTimeout as exc:
            log.error("%s failed: %s", what, exc)
            self._groups.pop(stage, None)
            return False

    def _group(self, stage: int, epoch: int, members: list[int]) -> DataPlaneGroup:
        cached = self._groups.get(stage)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        self._groups.pop(stage, None)
        group = build_group(self._store, f"ws/{stage}/{epoch}", 1 + members.index(self.worker_id),
                            len(members) + 1, self.cfg.backend, self.cfg.collective_timeout_s)
        self._groups[stage] = (epoch, group)
        return group

    def _receive_buckets(self, version: int, stage: int, attempt: int, group: DataPlaneGroup, what: str) -> None:
        index = 0
        while True:
            key = SyncKeys.bucket(version, stage, attempt, index)
            wait_key(self._store, key, self.cfg.collective_timeout_s, f"{what}: bucket {index} header")
            header = json.loads(self._store.get(key))
            if header.get("aborted"):
                raise TransportTimeout(f"{what}: the stage leader aborted the sync at bucket {index}")
            if header["last"]:
                return
            buf = torch.empty(header["size"], dtype=torch.uint8, device=group.device)
            group.broadcast(buf, 0, f"{what} bucket {index}")
            entries = [BucketEntry(**e) for e in header["entries"]]
            named = _unpack(entries, buf)
            if self._device is not None and self._device != buf.device:
                named = [(n, t.to(self._device)) for n, t in named]
            self._loaded_any = True
            self._load(named)
            index += 1
