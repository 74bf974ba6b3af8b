"""A rollout worker's end of weight sync (the protocol is in ``weight_sync.py``).

At each safe point the worker looks for a new offer; when there is one it posts "ready" with
its GPU UUID and host (so a leader on the same GPU can hand it CUDA IPC handles instead of a
broadcast), takes every PP stage's buckets, loads them into the engine in place, and acks.
Transport failures (a leader died, a broadcast timed out) cost this one version: the worker
keeps its old weights, waits for the next offer, and generates nothing meanwhile if those are
stale. An engine that cannot load the weights is different: nothing later can fix it, so the
worker posts why (the trainer's error names it) and raises ``WeightLoadError``.

A new process (a restarted worker of the same id) posts the version its engine holds as its ack
(its predecessor's no longer speaks for it), takes the current offer if that brings a newer
version, and follows only plans that name its own process: a round planned for its predecessor
is, for it, another worker's round.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from functools import partial
from typing import Callable, Iterable

import torch

from megatron_darl.transport.buckets import BucketEntry, unpack
from megatron_darl.transport.config import ControlPlaneConfig, WeightSyncConfig
from megatron_darl.transport.cuda_ipc import device_uuid, open_shared
from megatron_darl.transport.process_group import DataPlaneGroup, build_group
from megatron_darl.transport.shape import Topology
from megatron_darl.transport.store import (
    WORKER, ControlStore, MemberInfo, TransportTimeout, published_version, wait_key,
)
from megatron_darl.transport.weight_protocol import SyncKeys, WeightLoadError, parse_offer

RELAY_GRACE_S = 10.0  # a bucket the leader has sent may still be on its way through another member
RELAY_MIN_BYTES_PER_S = 100e6  # ... at this rate at least (a slower relay is given up)

log = logging.getLogger(__name__)


class WeightReceiver:
    """A rollout worker's end of weight sync; call ``maybe_sync`` at safe points.

    Args:
        load: ``Engine.load_weights``, called once per bucket with views into the received buffer.
        initial_version: version of the weights the engine starts with (0: the same checkpoint the
            trainer starts from), or -1 when the engine must wait for a first sync.
        device: move received tensors there before ``load`` (None: load them where they arrive).
        gpu: UUID of the GPU the engine runs on ("" for none; None: the current CUDA device).
    """

    def __init__(
        self, store: ControlStore, control: ControlPlaneConfig, cfg: WeightSyncConfig, topology: Topology, worker_id: int,
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], None], initial_version: int = 0,
        device: torch.device | None = None, gpu: str | None = None,
    ) -> None:
        self._store, self._control, self.cfg, self.worker_id = store, control, cfg, worker_id
        self.topology = topology
        self._load, self._device = load, device
        self._gpu = device_uuid() if gpu is None else gpu
        self.version = initial_version  # weights the engine holds now; -1 = none valid
        self._attempted = 0  # the last offer taken part in (offers count from 1)
        self._offered = initial_version  # the version the offer in progress brings
        store.set(SyncKeys.ack(worker_id), str(initial_version))  # this process's, not a predecessor's
        self._groups: dict[tuple[int, int], DataPlaneGroup] = {}  # (stage, epoch) -> group
        self._loaded_any = False  # a bucket of the sync in progress reached the engine
        self._sent: dict[int, int] = {}  # stage -> version its leader's plan says it sends
        self._late = False  # the sync in progress ended without a plan for this worker
        me = MemberInfo.here(WORKER, worker_id)
        self._me, self._proc = me.describe(), [me.host, me.pid]

    def pending(self) -> int | None:
        """The offer of stage 0 not yet attempted that brings a newer version than the engine's,
        or None (an offer of what the engine holds is for others: marked attempted)."""
        offer = parse_offer(self._store.read(SyncKeys.offer(0)))
        if offer is None or offer[0] <= self._attempted:
            return None
        if offer[1] <= self.version:
            self._attempted = offer[0]
            return None
        self._offered = offer[1]
        return offer[0]

    def can_generate(self) -> bool:
        """True while the engine holds at least the published version (docs/architecture.md)."""
        return self.version >= 0 and self.version >= published_version(self._store)

    def maybe_sync(self) -> int | None:
        """Take part in an offered sync, if any; returns the new version when it was loaded.

        Raises ``WeightLoadError`` (after posting it for the trainer) when the engine could not
        load the weights.
        """
        offer = self.pending()
        if offer is None:
            return None
        self._attempted, version = offer, self._offered
        ready = json.dumps({"gpu": self._gpu, "host": socket.gethostname(), "pid": self._proc[1]})
        self._store.set(SyncKeys.ready(offer, self.worker_id), ready)  # for every stage at once
        self._loaded_any = False
        self._late = False  # left out of every plan of the stage (no transport fault)
        self._sent = {}
        ok = True
        try:
            for stage in range(self.topology.stages):
                ok = self._receive_stage(offer, stage, ready) and ok
        except WeightLoadError as exc:
            self.version = -1 if self._loaded_any else self.version
            self._store.set(SyncKeys.failed(offer, self.worker_id), str(exc))
            raise
        if not ok and self._late and not self._loaded_any:  # served the others, and ended before us
            log.info("rollout %d: v%d went out before this safe point; the next offer brings a newer one",
                     self.worker_id, version)
            return None
        if not ok:
            if self._loaded_any:  # weights of two versions mixed: none is valid until the next sync
                self.version = -1
            self._store.set(SyncKeys.failed(offer, self.worker_id), "1")
            log.error("rollout %d: missed sync of v%d (engine keeps v%d); waiting for the next",
                      self.worker_id, version, self.version)
            return None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies into the engine are done before we ack
        sent = set(self._sent.values()) or {version}
        if len(sent) > 1:  # a leader bug, not a transport fault: say so and hold no version
            raise WeightLoadError(f"{self._me}: sync v{version} sent stages of versions {sorted(sent)}")
        self.version = sent.pop()  # the newest staged version, at least the one offered
        self._store.set(SyncKeys.ack(self.worker_id), str(self.version))
        return self.version

    def _receive_stage(self, offer: int, stage: int, ready: str) -> bool:
        """Receive one stage, following the leader's retries after a failed attempt."""
        attempt = 0
        while True:
            ok = self._receive_attempt(offer, stage, attempt)
            self._store.set(SyncKeys.result(offer, stage, attempt, self.worker_id), "1" if ok else "0")
            if ok:
                return True
            key = SyncKeys.verdict(offer, stage, attempt)
            try:
                wait_key(self._store, key, self.cfg.join_timeout_s + self.cfg.collective_timeout_s,
                         f"rollout {self.worker_id}, sync offer {offer} stage {stage}: verdict on attempt {attempt}")
            except TransportTimeout as exc:
                log.error("%s", exc)
                return False
            if self._store.get(key) != b"1":
                return False
            attempt += 1
            self._store.set(SyncKeys.retry_ready(offer, stage, attempt, self.worker_id), ready)

    def _receive_attempt(self, offer: int, stage: int, attempt: int) -> bool:
        what = f"rollout {self.worker_id}, sync offer {offer} stage {stage} attempt {attempt}"
        try:
            key = SyncKeys.plan(offer, stage, attempt)
            wait_key(self._store, key, self.cfg.join_timeout_s + self.cfg.collective_timeout_s,
                     f"{what}: plan of the stage leader")
            plan = json.loads(self._store.get(key))
            self._sent[stage] = int(plan.get("version", self._offered))
            mine = plan.get("procs", {}).get(str(self.worker_id), self._proc) == self._proc
            if self.worker_id not in plan["members"] or not mine:  # served later, in a round of its own
                log.debug("%s: another round's plan; following the leader to the next", what)
                self._late = True
                return False
            self._late = False
            group = None
            if self.worker_id not in plan.get("ipc", []):
                bcast = [w for w in plan["members"] if w not in plan.get("ipc", [])]
                group = self._group(stage, plan["epoch"], bcast, plan.get("backend", self.cfg.backend))
            self._receive_buckets(offer, stage, attempt, group, what)
            return True
        except TransportTimeout as exc:
            log.error("%s failed: %s", what, exc)
            self._late = False
            for key in [k for k in self._groups if k[0] == stage]:
                self._groups.pop(key).retire()
            return False

    def _group(self, stage: int, epoch: int, members: list[int], backend: str) -> DataPlaneGroup:
        """The leader's group of this plan: one per set of members, built on first use."""
        group = self._groups.get((stage, epoch))
        if group is None:
            group = build_group(self._store, f"ws/{stage}/{epoch}", 1 + members.index(self.worker_id),
                                len(members) + 1, backend, self.cfg.collective_timeout_s)
            self._groups[(stage, epoch)] = group
        return group

    def _receive_buckets(self, offer: int, stage: int, attempt: int, group: DataPlaneGroup | None,
                         what: str) -> None:
        """Every bucket of one attempt: broadcast over ``group``, or mapped by CUDA IPC (None).

        When the engine cannot load a broadcast bucket, this member still takes part in the
        attempt's remaining broadcasts (without loading them) and raises the load error after the
        last one: the leader and the other members never wait out a collective timeout on it.
        """
        index, failure = 0, None
        while True:
            key = SyncKeys.bucket(offer, stage, attempt, index)
            wait_key(self._store, key, self.cfg.collective_timeout_s, f"{what}: bucket {index} header")
            header = json.loads(self._store.get(key))
            if header.get("aborted"):
                if failure is not None:
                    raise failure
                raise TransportTimeout(f"{what}: the stage leader aborted the sync at bucket {index}")
            if header["last"]:
                if failure is not None:
                    raise failure
                return
            entries = [BucketEntry(**e) for e in header["entries"]]
            if group is None:
                self._load_ipc_bucket(header, entries, f"{what} bucket {index}")
                self._store.set(SyncKeys.done(offer, stage, attempt, index, self.worker_id), "1")
            else:
                buf = torch.empty(header["size"], dtype=torch.uint8, device=group.device)
                after = SyncKeys.bucket(offer, stage, attempt, index + 1)  # the leader's next header
                group.broadcast_watched(buf, 0, f"{what} bucket {index}",
                                        given_up=partial(self._abandoned, after, index, buf.numel(), {}))
                if failure is None:
                    try:
                        self._load_bucket(unpack(entries, buf), f"{what} bucket {index}")
                    except WeightLoadError as exc:
                        failure = exc  # drain the rest of the attempt, then raise
                        log.error("%s; taking the remaining buckets without loading them", exc)
            index += 1

    def _abandoned(self, after: str, index: int, nbytes: int, seen: dict[str, float]) -> str | None:
        """Why this member, waiting in bucket ``index``'s broadcast, will not get it, or None. The
        leader posts the next header (key ``after``) only once ``index`` is done on its side
        (``seen`` keeps when this member first saw it): one that says
        "aborted" means its broadcast failed (another member was killed; ``weight_sync._stream``).
        One that does not, while this member still waits ``RELAY_GRACE_S`` plus the bucket at
        ``RELAY_MIN_BYTES_PER_S`` later, means the member relaying it to us (gloo's broadcast is
        a tree) is gone."""
        raw = self._store.read(after)
        if raw is None:
            return None
        if json.loads(raw).get("aborted"):
            return f"the stage leader aborted the sync after bucket {index} (another member failed)"
        since = time.monotonic() - seen.setdefault("next", time.monotonic())
        if since > RELAY_GRACE_S + nbytes / RELAY_MIN_BYTES_PER_S:
            return f"the stage leader sent bucket {index} {since:.0f} s ago (a relaying member is gone)"
        return None

    def _load_ipc_bucket(self, header: dict, entries: list[BucketEntry], what: str) -> None:
        """Map the leader's buffer, load from it, and let go of it before saying "done"."""
        try:
            buf = open_shared(header["ipc"])
        except (ValueError, RuntimeError) as exc:
            raise WeightLoadError(f"{self._me}: cannot map the leader's weights ({what}): {exc}") from exc
        self._load_bucket(unpack(entries, buf), what)
        torch.cuda.synchronize(buf.device)  # our reads of the leader's memory are over
        del buf

    def _load_bucket(self, named: list[tuple[str, torch.Tensor]], what: str) -> None:
        if self._device is not None:
            named = [(n, t.to(self._device)) for n, t in named]
        self._loaded_any = True
        try:
            self._load(named)
        except Exception as exc:  # noqa: BLE001 - any engine error means this engine cannot go on
            raise WeightLoadError(f"{self._me}: the engine could not load the weights ({what}): "
                                  f"{type(exc).__name__}: {exc}") from exc
