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

Failures are loud (docs/architecture.md, Failures): a worker whose engine cannot load the weights posts
why and exits (``WeightLoadError``); a sync that no ready worker could take raises
``WeightSyncFailed`` on the leader with each worker's reason, so the trainer checkpoints and
stops instead of training on while every worker waits for weights that never come.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import time
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_darl.transport.buckets import buckets, pack
from megatron_darl.transport.config import ControlPlaneConfig, WeightSyncConfig
from megatron_darl.transport.cuda_ipc import device_uuid, share
from megatron_darl.transport.heartbeat import Heartbeat
from megatron_darl.transport.process_group import DataPlaneGroup, build_group
from megatron_darl.transport.store import (
    WORKER, ControlStore, Keys, TransportTimeout, describe_peer, get_int, published_version, wait_key,
)
from megatron_darl.transport.weight_protocol import (  # noqa: F401 (re-exported: the sender's vocabulary)
    PackedBucket, StagedWeights, SyncKeys, SyncReport, WeightLoadError, WeightSyncFailed,
)

log = logging.getLogger(__name__)
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
        # data-plane groups by (backend, broadcast members), built once each: rounds to different
        # subsets of workers reuse them; a member that fails takes its groups with it
        self._groups: dict[tuple[str, tuple[int, ...]], tuple[int, DataPlaneGroup]] = {}
        self._epoch = 0  # store prefix counter of this stage's groups
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
        one-shot iterator serves one round. ``upgrade`` gives the newest staged weights (at least
        ``version``) for each round: the plan and the report name the version sent. Once a round
        went out, ``newer()`` true ends the publish: the workers still to come get the newer version
        from the next one, offered as soon as this one returns.
        Raises ``WeightSyncFailed`` when every worker that took part failed, or (stage 0) none
        loaded the version; with no worker ready within ``join_timeout_s`` the version is not
        published and the report names the ones left out.
        """
        start = time.monotonic()
        deadline = start + self.cfg.join_timeout_s
        self._store.set(SyncKeys.offer(self.stage), str(version))
        report = SyncReport(version=version, stage=self.stage, members=[])
        retriable = callable(named_tensors) or isinstance(named_tensors, (list, tuple, StagedWeights))
        done: set[int] = set()  # served, or given up on
        tries: dict[int, int] = {}  # failed rounds per worker
        acks = _Acks(self, version, report) if self.stage == 0 else None
        for rnd in itertools.count():
            todo = [w for w in self._live_workers() if w not in done]
            waited = time.monotonic()
            if any(w in tries for w in todo):  # a member that failed gets a fresh window to come back
                deadline = max(deadline, waited + self.cfg.join_timeout_s)
            members, waiting = self._gather_ready(version, rnd, todo, deadline, acks)
            report.wait_seconds += time.monotonic() - waited
            ok, sent = [], version
            if members:
                source = upgrade() if upgrade is not None else named_tensors
                ok, sent = self._round(version, rnd, members, source, report)
                done |= set(ok)
                for w in set(members) - set(ok):
                    tries[w] = tries.get(w, 0) + 1
                    if (not retriable or tries[w] >= self.cfg.max_attempts or self._hb.is_lost(WORKER, w)
                            or self._gave_up(version, w)):
                        done.add(w)
                        report.missing.append(self._failure(version, w))
            else:  # nobody (more) came: an empty plan, so a late walker learns it missed this version
                self._store.set(SyncKeys.plan(version, self.stage, rnd), json.dumps({"members": []}))
                if waiting:
                    self._left_out(version, waiting, report)
            more = members and not newer() and any(w not in done for w in self._live_workers())
            self._store.set(SyncKeys.verdict(version, self.stage, rnd), "1" if more else "0")
            if acks is not None:  # polled, not awaited: a member may still be in another stage's round
                acks.expect(ok, sent)
            if not more:
                report.attempts = rnd + 1
                break
        if acks is not None:
            acks.wait(self.cfg.ack_timeout_s)
        self._conclude(version, tries, report)
        report.seconds = time.monotonic() - start
        return report

    def _round(self, version: int, rnd: int, members: list[int], source: NamedTensors | StagedWeights,
               report: SyncReport) -> tuple[list[int], int]:
        """Send ``source`` to ``members``: (those that loaded it, the version sent)."""
        sent = source.version if isinstance(source, StagedWeights) else version
        began = time.monotonic()
        failed = self._attempt(version, rnd, members, source() if callable(source) else source, report, sent)
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

    def _conclude(self, version: int, tries: dict[int, int], report: SyncReport) -> None:
        """Fail loudly when workers took part and none of them loaded the version."""
        if not report.members and tries:
            reasons = "; ".join(self._failure(version, w) for w in sorted(tries))
            raise WeightSyncFailed(f"weight sync v{version} stage {self.stage} failed for every rollout "
                                   f"worker: {reasons}")
        if self.stage == 0 and not report.members:
            log.error("weight sync v%d: no live rollout worker took part; published version stays", version)
        elif self.stage == 0 and not report.acked:
            raise WeightSyncFailed(f"weight sync v{report.version}: no rollout worker loaded it: "
                                   f"{'; '.join(report.missing)}")

    # ---- one attempt --------------------------------------------------------------------------
    def _attempt(self, version: int, attempt: int, members: list[int],
                 source: Iterable[tuple[str, torch.Tensor]] | StagedWeights, report: SyncReport,
                 sent: int) -> list[int]:
        """One round of the stage to ``members``; returns the members it failed for."""
        ipc = [w for w in members if self._shares_gpu(version, w)]
        bcast = [w for w in members if w not in ipc]
        backend = self._backend(version, bcast)
        cached = self._groups.get((backend, tuple(bcast))) if bcast else None
        if bcast and cached is None:
            self._epoch += 1
        epoch = cached[0] if cached is not None else self._epoch
        plan = {"epoch": epoch, "members": members, "ipc": ipc, "backend": backend, "version": sent}
        self._store.set(SyncKeys.plan(version, self.stage, attempt), json.dumps(plan))
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
                self._groups[(backend, tuple(bcast))] = (epoch, group)
            elif cached is not None:
                group = cached[1]
            report.buckets, report.bytes = self._stream(version, attempt, source, ipc, group)
        except TransportTimeout as exc:
            log.error("weight sync v%d stage %d round %d failed, members %s: %s",
                      version, self.stage, attempt, members, exc)
        failed = self._member_results(version, attempt, members)
        if failed:  # a member died or failed: its end of every group it is in is gone
            self._groups = {k: v for k, v in self._groups.items() if not set(k[1]) & set(failed)}
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

    def _live_workers(self) -> list[int]:
        self._hb.refresh(self._store)
        return [w for w in range(self._control.num_workers) if self._hb.is_alive(WORKER, w)]

    def _gather_ready(self, version: int, rnd: int, todo: list[int], deadline: float,
                      acks: "_Acks | None" = None) -> tuple[list[int], list[int]]:
        """(ready, waiting) among ``todo``: returns once all are at a safe point, ``gather_s``
        after the first one was, or at ``deadline`` (with whoever is ready). A worker stuck before
        its safe point is not the sync's to judge: the loop's progress watch names it if it never
        comes back."""
        first = None
        while True:
            ready = [w for w in todo if self._store.check([
                SyncKeys.ready(version, w) if rnd == 0 else SyncKeys.retry_ready(version, self.stage, rnd, w)])]
            waiting = [w for w in todo if w not in ready]
            now = time.monotonic()
            first = first if first is not None or not ready else now
            if not waiting or now > deadline or (first is not None and now - first >= self.cfg.gather_s):
                return ready, waiting
            time.sleep(self._control.poll_interval_s)
            self._hb.refresh(self._store)
            todo = [w for w in todo if not self._hb.is_lost(WORKER, w)]
            if acks is not None:  # the published version moves while later workers are awaited
                acks.poll()

    # ---- streaming ----------------------------------------------------------------------------
    def _stream(self, version: int, attempt: int, source: Iterable[tuple[str, torch.Tensor]] | StagedWeights,
                ipc: list[int], group: DataPlaneGroup | None) -> tuple[int, int]:
        state = {"n": 0, "attempt": attempt}
        try:
            return self._stream_buckets(version, self._packed(source, ipc, group), state, ipc, group)
        except TransportTimeout:
            key = SyncKeys.bucket(version, self.stage, attempt, state["n"])
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

    def _stream_buckets(self, version: int, packed: Iterator[PackedBucket], state: dict,
                        ipc: list[int], group: DataPlaneGroup | None) -> tuple[int, int]:
        n, total, pending = 0, 0, None
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


class _Acks:
    """Stage 0's acks of one publish: polled between rounds (the published version moves to a
    version as soon as one worker acked it), awaited for everyone at the end."""

    def __init__(self, sender: WeightSender, version: int, report: SyncReport) -> None:
        self._sender, self._version, self._report = sender, version, report
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
                if sent > published_version(store) or not store.check([Keys.PUBLISHED]):
                    store.set(Keys.PUBLISHED, str(sent))
                report.published = True
            elif self._sender._hb.is_lost(WORKER, w) or self._sender._gave_up(self._version, w):
                del self._pending[w]
                report.missing.append(self._sender._failure(self._version, w))

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
