"""The two ends of one worker -> hub sample link, each a thread of its own (see ``channel.py``).

``OutLink`` (rollout worker, one per hub) takes framed groups from a queue and, per group, posts
its header in the control store and sends the payload; ``InLink`` (trainer hub, one per worker)
waits for the next header, takes the payload, hands the group to the hub and acks it. With the
``dataplane`` transport the payload crosses a two-member process group of the pair's own (rank 0
the hub, rank 1 the worker; gloo, or NCCL between distinct GPUs) built lazily under an epoch:
the worker draws a new epoch (a store counter) whenever it (re)builds, the header names it, and a
hub that sees a new epoch says so (``Keys.sample_pair_ready``) and builds that pair; the worker
builds it only then. A transfer that fails or outlasts ``transfer_timeout_s`` drops its pair on
both sides; the worker retries the group once on a new epoch, and the hub waits for a header of
a newer epoch (a dead worker's pair is never used again). With the ``store`` transport the
payload rides inside the header value.

Why the worker waits for the hub before it builds: a hub link serves one pair at a time, and
may be busy with a dead process's pair (a worker killed mid-transfer: a build that waits
``connect_timeout_s`` for it, a receive that waits ``transfer_timeout_s``). A restarted worker
that built at once would time its build out meanwhile, try once more, and give up for good
while the hub was still busy. Waiting for the hub's word costs one look at the store per new
pair, and bounds the wait by what the hub can spend on one dead pair. The hub in turn builds only
once the worker took its word (deleted the ready key): a worker killed between its header and its
build is given up as soon as its restart draws a newer epoch, not after ``connect_timeout_s``
(during which the staleness bound held that worker's starts and no step was trained).

Batching: a data-plane out-link sends every group waiting in its queue (at most the worker's
``max_unacked_per_hub``) as one transfer under one header (the first seq, a count), and the hub
acks the last seq of it once: the per-transfer cost (a header, a receive, an ack, the staleness
count) is paid per batch, not per group; on 2x H200 that cost, not the bytes, bounded the channel
(~7 ms per 1.4 MB group). The store transport stays one group per key: its values share the
control store with heartbeats and acks, so they stay small.

Each link owns its store connection and blocks only itself: a slow, frozen or dead peer stalls one
thread, never the hub's loop or the other links. Every wait has a deadline (store calls, pair
construction, transfers). A hub link's store request that may run twice (the header's read, the
ack, the header's delete) is made again when it misses its deadline, up to three times: a store
busy for one deadline does not end the link. An idle hub link looks for its next header with one
store read, every 0.5 ms while the link is busy (within 50 ms of its last transfer), then backing
off to 50 ms (a native store wait would log a warning at every timed-out slice), so the first group
after an idle spell waits at most 50 ms and a busy link hardly waits. The back-off does not start
at once: a worker's next header, due a few ms after a transfer, would then be seen only at the next
look of 0.5, 1.5, 3.5, 7.5 ms, bounding a busy link by the hub's sleeps, not the work.
"""

from __future__ import annotations

import datetime as _dt
import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_darl.transport.config import ChannelConfig, ControlPlaneConfig
from megatron_darl.transport.errors import again_on_timeout
from megatron_darl.transport.frames import ReceivedGroup, host_cat, split_frames, unframe_group
from megatron_darl.transport.process_group import DataPlaneGroup, build_group
from megatron_darl.transport.staleness import mark_delivered
from megatron_darl.transport.store import ControlStore, Keys, TransportTimeout, connect_store, get_int

log = logging.getLogger(__name__)
BACKENDS = ("store", "gloo", "nccl")  # where a header says the payload is
_FIRST_POLL_S = 0.0005  # sleep between looks for the next header while the link is busy
_BUSY_S = 0.05  # a link counts as busy this long after its last transfer: no back-off meanwhile
_IDLE_POLL_S = 0.05  # longest sleep between two looks for the next header (backs off to it)
_FAILURES = (TransportTimeout, RuntimeError, dist.DistError, ValueError)
_STORE_TRIES = 3  # a hub link's repeatable store request, tried this often before the link ends


@dataclass(frozen=True)
class Header:
    """What the store carries per group (plus the payload itself with the ``store`` transport)."""

    seq: int  # per (worker, hub) sequence number
    epoch: int  # the pair the payload crosses (0: no pair, ``store`` transport)
    backend: str  # one of BACKENDS
    nbytes: int  # payload bytes (``GroupFrame.to_buffer`` of each group, end to end)
    group_id: int  # of the first group, for error messages
    count: int = 1  # groups in the payload: seqs seq .. seq + count - 1

    _FMT = "<4sqqBqqq"

    def to_bytes(self, payload: bytes = b"") -> bytes:
        return struct.pack(self._FMT, b"DCH2", self.seq, self.epoch, BACKENDS.index(self.backend),
                           self.nbytes, self.group_id, self.count) + payload

    @classmethod
    def from_bytes(cls, data: bytes) -> tuple["Header", bytes]:
        size = struct.calcsize(cls._FMT)
        if len(data) < size:
            raise ValueError(f"not a sample-channel header ({len(data)} bytes)")
        magic, seq, epoch, backend, nbytes, group_id, count = struct.unpack_from(cls._FMT, data, 0)
        if magic != b"DCH2" or backend >= len(BACKENDS) or count < 1:
            raise ValueError("not a sample-channel header")
        return cls(seq, epoch, BACKENDS[backend], nbytes, group_id, count), data[size:]


def _finish(work, pair: DataPlaneGroup, timeout_s: float, what: str) -> None:
    """Wait for one send/recv, at most ``timeout_s``. gloo: its own timed wait. NCCL: poll the
    work's CUDA event (a timed NCCL wait would leave it to the watchdog) and abort the pair's
    communicator past the deadline, so a stuck peer costs this link its pair, not the process."""
    if pair.backend != "nccl":
        work.wait(_dt.timedelta(seconds=timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            for name in ("abort", "_abort", "shutdown", "_shutdown"):  # names differ across torch releases
                if callable(getattr(pair.pg, name, None)):
                    getattr(pair.pg, name)()
                    break
            raise TransportTimeout(f"{pair.name}: {what} not done after {timeout_s:.0f} s")
        time.sleep(0.0005)
    work.wait()


def _what(count: int, group_id: int, seq: int) -> str:
    """A transfer of ``count`` groups from ``group_id`` (at ``seq``) as error messages name it."""
    if count == 1:
        return f"group {group_id}"
    return f"{count} groups from group {group_id} (seqs {seq}..{seq + count - 1})"


def _pair_name(hub: int, worker: int, epoch: int) -> str:
    return f"ch/{hub}/{worker}/{epoch}"


class InLink:
    """Hub side of one worker's link: receive its groups in order, hand them over, ack them."""

    def __init__(self, control: ControlPlaneConfig, cfg: ChannelConfig, hub: int, worker: int,
                 device: torch.device, deliver: Callable[[ReceivedGroup], None], stop: threading.Event) -> None:
        self.control, self.cfg, self.hub, self.worker, self.device = control, cfg, hub, worker, device
        self._deliver, self._stop = deliver, stop
        self._pair: DataPlaneGroup | None = None
        self._epoch = -1  # epoch of ``_pair``
        self._dead: set[int] = set()  # epochs whose pair failed: never built again
        self.transfers = 0  # transfers taken (each one header, one payload, one ack)
        self.fenced = 0  # groups refused: sent by a generation declared lost (``staleness.py``)
        # from the ledger's ``arrive`` of a transfer until its groups are in the hub's queue: the
        # ledger counts them delivered before ``SampleHub.poll`` can return them (``SampleHub.settled``)
        self.handing_over = False
        self.thread = threading.Thread(target=self._run, name=f"channel-in-{hub}-{worker}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        store = None
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            store = connect_store(self.control, who=f"hub {self.hub} (link of rollout {self.worker})")
            seq = get_int(store, Keys.sample_ack(self.hub, self.worker), -1) + 1
            nap, last = _FIRST_POLL_S, time.monotonic()
            while not self._stop.is_set():
                if taken := self._take(store, seq):
                    seq, nap, last = seq + taken, _FIRST_POLL_S, time.monotonic()
                else:  # idle: look less often, up to _IDLE_POLL_S (the store serves every link)
                    self._stop.wait(nap)
                    if time.monotonic() - last > _BUSY_S:
                        nap = min(2 * nap, _IDLE_POLL_S)
        except Exception as exc:  # noqa: BLE001 - the link ends; the hub's progress watch names the worker
            if not self._stop.is_set():
                log.error("hub %d: the link of rollout %d ended: %s", self.hub, self.worker, exc)
        finally:
            self._pair = None
            if store is not None:
                store.close()

    def _take(self, store: ControlStore, seq: int) -> int:
        """Receive the transfer that starts at ``seq`` if its header is there; returns the groups
        taken (0: none yet; never waits for one)."""
        key = Keys.sample(self.hub, self.worker, seq)
        raw = self._patiently(lambda: store.read(key))  # one round trip: absent, or foreign (unsigned): not there
        if raw is None:
            return 0
        head, inline = Header.from_bytes(raw)
        if head.backend == "store":
            buf = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
        elif head.epoch in self._dead:  # the worker has not re-posted on a new pair yet
            return 0
        else:
            buf = self._receive(store, head)
            if buf is None:
                return 0
        got = [unframe_group(frame) for frame in split_frames(buf, head.count)]
        for i, g in enumerate(got):
            if g.meta.seq != seq + i or g.group.worker_id != self.worker:
                raise ValueError(f"key {key}: group {i} of {head.count} holds seq {g.meta.seq} of worker "
                                 f"{g.group.worker_id}, expected seq {seq + i} of worker {self.worker}")
        self.transfers += 1  # before the hand-over: whoever holds a group sees its transfer counted
        self.handing_over = True  # before the ledger hears of them
        try:
            for g in self._admitted(store, got):
                self._deliver(g)
        finally:
            self.handing_over = False
        # ack, then delete: a missing header at or below the ack is then never a consumed one in
        # between (a restarting worker reads a missing key above the ack as a free seq)
        self._patiently(lambda: store.set(Keys.sample_ack(self.hub, self.worker), str(seq + head.count - 1)))
        self._patiently(lambda: store.delete_key(key))
        return head.count

    def _patiently(self, request: Callable[[], object]) -> object:
        """``request()``, made again when it outlasts its deadline (the store client drops that
        connection and opens another), up to ``_STORE_TRIES`` times: a store busy for one call's
        deadline must not end the link, after which this worker's groups would wait for the run's
        receive timeout. Only for requests that may run twice: the header's read, the ack's set,
        the header's delete. The ledger's ``arrive`` (``_admitted``) counts, so it is tried again
        as the same request instead (``ledger.call_once``)."""
        return again_on_timeout(request, _STORE_TRIES, f"hub {self.hub}, link of rollout {self.worker}",
                                self._stop.is_set)

    def _admitted(self, store: ControlStore, got: list[ReceivedGroup]) -> list[ReceivedGroup]:
        """The groups of a transfer no longer outstanding (``staleness.mark_delivered``), one
        ledger request per generation in it; those of a fenced generation are refused (logged,
        counted in ``fenced``) but acked like the rest, so the worker moves on."""
        out = []
        for gen in sorted({g.meta.generation for g in got}):
            mine = [g for g in got if g.meta.generation == gen]
            if mark_delivered(store, self.worker, len(mine), gen):
                out += mine
                continue
            self.fenced += len(mine)
            log.warning("hub %d: refused %d group(s) of rollout %d (group %s): its generation %d was declared "
                        "lost and its starts given back; groups started in their place are trained instead",
                        self.hub, len(mine), self.worker, ", ".join(str(g.group.group_id) for g in mine), gen)
        return sorted(out, key=lambda g: g.meta.seq)

    def _receive(self, store: ControlStore, head: Header) -> torch.Tensor | None:
        """The payload over the pair of ``head.epoch`` (built first when new), or None on failure."""
        try:
            if head.epoch != self._epoch:
                self._pair, self._epoch = None, head.epoch
                store.set(Keys.sample_pair_ready(self.hub, self.worker, head.epoch), "1")  # the worker builds now
                self._await_worker(store, head.epoch)
                self._pair = build_group(store, _pair_name(self.hub, self.worker, head.epoch), 0, 2,
                                         head.backend, self.cfg.connect_timeout_s,
                                         collective_timeout_s=self.cfg.transfer_timeout_s + 60)
            pair = self._pair
            buf = torch.empty(head.nbytes, dtype=torch.uint8, device=pair.device)
            _finish(pair.pg.recv([buf], 1, 0), pair, self.cfg.transfer_timeout_s,
                    _what(head.count, head.group_id, head.seq))
            return buf.cpu()
        except _FAILURES as exc:
            log.warning("hub %d: rollout %d's group %d (seq %d) did not arrive on pair epoch %d: %s; "
                        "dropping that pair", self.hub, self.worker, head.group_id, head.seq, head.epoch, exc)
            self._dead.add(head.epoch)
            self._pair, self._epoch = None, -1
            return None

    def _await_worker(self, store: ControlStore, epoch: int) -> None:
        """Wait until the worker takes the hub's word for the pair of ``epoch`` (it deletes the
        ready key, then builds), at most ``connect_timeout_s``. A worker killed between its header
        and its build never comes, and a build would wait all of the connect timeout for it while
        the staleness bound holds its starts (a minute without a step on CPU, all workers). A newer
        epoch drawn meanwhile means the process that posted this one is gone (its restart re-posts
        the first unacked seq on a new pair): the pair is dropped at once."""
        key = Keys.sample_pair_ready(self.hub, self.worker, epoch)
        deadline, nap = time.monotonic() + self.cfg.connect_timeout_s, _FIRST_POLL_S
        while store.check([key]):
            if store.add(Keys.sample_epoch(self.hub, self.worker), 0) > epoch:  # the counter, unchanged
                raise TransportTimeout(f"a newer pair replaced it before rollout {self.worker} joined it "
                                       f"(the process that posted it is gone)")
            if time.monotonic() > deadline or self._stop.is_set():
                raise TransportTimeout(f"rollout {self.worker} did not join it within "
                                       f"{self.cfg.connect_timeout_s:.0f} s (connect_timeout_s)")
            self._stop.wait(nap)
            nap = min(2 * nap, _IDLE_POLL_S)


@dataclass
class Outgoing:
    """A framed group on its way to a hub."""

    seq: int  # per (worker, hub) sequence number
    buffer: torch.Tensor  # (B,) uint8 ``GroupFrame.to_buffer``
    group_id: int  # for error messages


class OutLink:
    """Worker side of the link to one hub: send queued groups in order, each exactly once."""

    def __init__(self, control: ControlPlaneConfig, cfg: ChannelConfig, worker: int, hub: int,
                 device: torch.device, backend: Callable[[ControlStore], str]) -> None:
        self.control, self.cfg, self.worker, self.hub, self.device = control, cfg, worker, hub, device
        self._backend = backend  # the pair's backend, decided once per pair from the hub's info
        self._queue: queue.Queue[Outgoing | None] = queue.Queue()
        self._busy = 0  # queued or being sent
        self._lock = threading.Lock()
        self.error = ""  # why the link gave up ("" while it works)
        self._pair: DataPlaneGroup | None = None
        self._epoch = 0  # epoch of ``_pair``
        self.thread = threading.Thread(target=self._run, name=f"channel-out-{worker}-{hub}", daemon=True)
        self.thread.start()

    def put(self, item: Outgoing) -> None:
        with self._lock:
            self._busy += 1
        self._queue.put(item)

    def busy(self) -> int:
        """Groups queued or being sent."""
        with self._lock:
            return self._busy

    def close(self, timeout_s: float = 5.0) -> None:
        """End the thread once the queue is sent (at most ``timeout_s``; it is a daemon)."""
        self._queue.put(None)
        self.thread.join(timeout_s)

    def _run(self) -> None:
        store = None
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            store = connect_store(self.control, who=f"rollout {self.worker} (link to hub {self.hub})")
            while (batch := self._next_batch()) is not None:
                self._send(store, batch)
                with self._lock:
                    self._busy -= len(batch)
        except Exception as exc:  # noqa: BLE001 - surfaced by SampleSender.send in the worker's thread
            self.error = str(exc)
            log.error("rollout %d: the link to hub %d gave up: %s", self.worker, self.hub, exc)
        finally:
            self._pair = None
            if store is not None:
                store.close()

    def _await_hub(self, store: ControlStore, epoch: int) -> None:
        """Wait until the hub starts building the pair of ``epoch`` (module docstring), at most
        what it can spend on an older pair of ours (its build and its receive) and its own build."""
        budget = 2 * self.cfg.connect_timeout_s + self.cfg.transfer_timeout_s
        deadline, nap = time.monotonic() + budget, _FIRST_POLL_S
        key = Keys.sample_pair_ready(self.hub, self.worker, epoch)
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise TransportTimeout(f"rollout {self.worker}: hub {self.hub} did not start on pair epoch {epoch} "
                                       f"within {budget:.0f} s (2 x connect_timeout_s + transfer_timeout_s)")
            time.sleep(nap)
            nap = min(2 * nap, _IDLE_POLL_S)
        store.delete_key(key)

    def _next_batch(self) -> list[Outgoing] | None:
        """The next group and, with the data plane, every group queued behind it (the queue holds
        at most ``max_unacked_per_hub``); None once closed and drained."""
        if (first := self._queue.get()) is None:
            return None
        batch = [first]
        while self.cfg.transport != "store":
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # closed: send this batch, then end
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _send(self, store: ControlStore, batch: list[Outgoing]) -> None:
        first = batch[0]
        key = Keys.sample(self.hub, self.worker, first.seq)
        if self.cfg.transport == "store":
            for item in batch:
                store.set(Keys.sample(self.hub, self.worker, item.seq),
                          Header(item.seq, 0, "store", int(item.buffer.numel()), item.group_id)
                          .to_bytes(item.buffer.numpy().tobytes()))
            return
        payload = host_cat([item.buffer for item in batch], torch.uint8)
        nbytes, count = int(payload.numel()), len(batch)
        failure: Exception | None = None
        for _ in range(2):  # a failed transfer is retried once, on a new pair
            try:
                if self._pair is None:  # header first: the hub builds the pair the header names
                    self._epoch = store.add(Keys.sample_epoch(self.hub, self.worker), 1)
                    backend = self._backend(store)
                    store.set(key, Header(first.seq, self._epoch, backend, nbytes, first.group_id, count).to_bytes())
                    self._await_hub(store, self._epoch)
                    self._pair = build_group(store, _pair_name(self.hub, self.worker, self._epoch), 1, 2,
                                             backend, 2 * self.cfg.connect_timeout_s,
                                             collective_timeout_s=self.cfg.transfer_timeout_s + 60)
                else:
                    store.set(key, Header(first.seq, self._epoch, self._pair.backend, nbytes,
                                          first.group_id, count).to_bytes())
                buf = payload.to(self._pair.device)
                _finish(self._pair.pg.send([buf], 0, 0), self._pair, self.cfg.transfer_timeout_s,
                        _what(count, first.group_id, first.seq))
                return
            except _FAILURES as exc:
                failure, self._pair = exc, None
        raise TransportTimeout(f"rollout {self.worker}: {count} group(s) from group {first.group_id} "
                               f"(seq {first.seq}) did not reach hub {self.hub} in two tries: {failure}")
