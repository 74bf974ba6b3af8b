"""Data-plane process groups built directly over the control-plane store.

Why not ``torch.distributed.init_process_group``/``new_group``: a trainer rank already holds the
Megatron default group, and a process may have only one default group. The data plane is
therefore constructed as standalone ``ProcessGroupGloo``/``ProcessGroupNCCL`` objects over a
``PrefixStore`` of the trainer's TCPStore; they share nothing with the default group, so a trainer
rank can hold both. Members change when a worker dies or joins, so groups are keyed by an epoch
prefix and rebuilt rather than repaired.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron_darl.transport.store import ControlStore, TransportTimeout


@dataclass
class DataPlaneGroup:
    """One data-plane group and how to address it."""

    pg: dist.ProcessGroup  # the standalone process group
    rank: int  # this process's rank in it
    size: int  # members
    backend: str  # "gloo" or "nccl"
    name: str  # store prefix, used in errors
    timeout_s: float  # timeout of every collective on it
    _works: list = field(default_factory=list, repr=False)  # collectives started, not seen over

    @property
    def device(self) -> torch.device:
        """Where tensors for this group must live."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, root: int, what: str) -> None:
        """In-place broadcast from group rank ``root`` with the group timeout; errors say ``what``."""
        self.broadcast_async(tensor, root, what)()

    def broadcast_async(self, tensor: torch.Tensor, root: int, what: str,
                        given_up: Callable[[], str | None] | None = None) -> Callable[[], None]:
        """Start an in-place broadcast; returns a function that waits for it (with the timeout),
        on a gloo group while asking ``given_up`` as ``broadcast_watched`` does, when given: the
        root of a broadcast one member walked away from (it posted its failure) would otherwise
        wait until that member's end of the pair closes, or for the group timeout."""
        work = self._start_broadcast(tensor, root, what)
        if given_up is not None and self.backend == "gloo":
            return lambda: self._wait_watched(work, what, given_up, 1.0)

        def wait() -> None:
            try:
                if not work.wait(_dt.timedelta(seconds=self.timeout_s)):
                    raise TransportTimeout(f"{self.name}: broadcast of {what} timed out after {self.timeout_s:.0f} s")
            except (RuntimeError, dist.DistError) as exc:
                raise TransportTimeout(f"{self.name} rank {self.rank}: broadcast of {what} failed: {exc}") from exc

        return wait

    def _start_broadcast(self, tensor: torch.Tensor, root: int, what: str):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        opts.timeout = _dt.timedelta(seconds=self.timeout_s)
        try:
            work = self.pg.broadcast([tensor], opts)
        except (RuntimeError, dist.DistError) as exc:
            raise TransportTimeout(f"{self.name} rank {self.rank}: broadcast of {what} failed: {exc}") from exc
        self._works = [w for w in self._works if not w.is_completed()] + [work]
        return work

    def retire(self) -> None:
        """Let go of this group without waiting for it. A gloo group's destructor joins its
        threads, and one still in a collective that a member walked away from holds them until
        that member's end closes or the group timeout: dropping the last reference there would
        stall the caller (a stage leader between rounds, a worker before it posts its result) for
        up to the whole timeout. A daemon thread keeps the group until its collectives are over,
        so whoever drops the last reference does so at once; one still waiting at exit is left."""
        works, self._works = [w for w in self._works if not w.is_completed()], []
        if works:
            threading.Thread(target=_hold_until_done, args=(self, works), daemon=True,
                             name=f"retire {self.name}").start()

    def broadcast_watched(self, tensor: torch.Tensor, root: int, what: str,
                          given_up: Callable[[], str | None], first_look_s: float = 1.0) -> None:
        """``broadcast`` for a member that receives over gloo: while it waits it asks ``given_up``
        (after ``first_look_s``, then every 0.2 s) whether the sender abandoned the broadcast,
        and raises ``TransportTimeout`` with that reason at once. A root whose send to another
        member failed (that member was killed) never sends the rest, and the collective alone
        would hold this member for the whole group timeout. A gloo collective runs on the group's
        own thread, so walking away leaves only that dropped group waiting; an NCCL one would keep
        the device stream, so NCCL groups wait as ``broadcast`` does."""
        if self.backend != "gloo":
            self.broadcast(tensor, root, what)
            return
        self._wait_watched(self._start_broadcast(tensor, root, what), what, given_up, first_look_s)

    def _wait_watched(self, work, what: str, given_up: Callable[[], str | None], first_look_s: float) -> None:
        try:
            start, nap, next_look = time.monotonic(), 0.0005, first_look_s
            while not work.is_completed():
                waited = time.monotonic() - start
                if waited > self.timeout_s:
                    raise TransportTimeout(f"{self.name}: broadcast of {what} timed out after {self.timeout_s:.0f} s")
                if waited >= next_look:
                    next_look = waited + 0.2
                    if (why := given_up()) is not None:
                        raise TransportTimeout(f"{self.name} rank {self.rank}: broadcast of {what} given up: {why}")
                time.sleep(nap)
                nap = min(2 * nap, 0.01)
            work.wait()  # raises the collective's own error, if any
        except (RuntimeError, dist.DistError) as exc:
            raise TransportTimeout(f"{self.name} rank {self.rank}: broadcast of {what} failed: {exc}") from exc


def _hold_until_done(group: DataPlaneGroup, works: list) -> None:
    """Keep ``group`` alive until ``works`` are over (each ends by the group timeout at most)."""
    deadline = time.monotonic() + group.timeout_s + 60
    while any(not w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.5)


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` when CUDA is available, else ``gloo``."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def build_group(
    store: ControlStore | dist.Store, name: str, rank: int, size: int, backend: str, timeout_s: float,
    collective_timeout_s: float | None = None,
) -> DataPlaneGroup:
    """Construct a standalone group of ``size`` members under store prefix ``name``.

    Blocks until every member constructed it, at most ``timeout_s``: gloo connects in its
    constructor, NCCL in a first all-reduce made here (``_connect_nccl``); ``collective_timeout_s``
    (default ``timeout_s``) is the group's own timeout of each operation (for NCCL, its watchdog's).
    """
    if not 0 <= rank < size:
        raise ValueError(f"{name}: rank {rank} outside group of size {size}")
    backend = resolve_backend(backend)
    raw = store.data_plane if isinstance(store, ControlStore) else store
    prefixed = dist.PrefixStore(f"dp/{name}/", raw)
    op_timeout_s = timeout_s if collective_timeout_s is None else collective_timeout_s
    timeout = _dt.timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _dt.timedelta(seconds=op_timeout_s)
            pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
            _connect_nccl(pg, name, rank, size, timeout_s)
        else:
            raise ValueError(f"WeightSyncConfig.backend: unknown backend {backend!r}")
    except (RuntimeError, dist.DistError) as exc:
        raise TransportTimeout(
            f"data-plane group {name}: rank {rank}/{size} could not connect within {timeout_s:.0f} s: {exc}"
        ) from exc
    return DataPlaneGroup(pg=pg, rank=rank, size=size, backend=backend, name=name, timeout_s=op_timeout_s)


def _connect_nccl(pg: dist.ProcessGroup, name: str, rank: int, size: int, timeout_s: float) -> None:
    """Connect an NCCL group now, within ``timeout_s``. NCCL builds its communicator at the first
    collective, in the calling thread, and a member that agreed to the group but never constructed
    it (killed in between) leaves that call waiting with no deadline of its own: the hub's link or
    the weight-sync leader would stop there for good. So every member all-reduces a one here, on
    a thread of its own, and the caller waits for the sum at most ``timeout_s``. A connect that
    misses it is aborted where torch can abort it, and its thread is left behind (a daemon)."""
    device = torch.cuda.current_device()
    failure: list[BaseException] = []
    done = threading.Event()

    def connect() -> None:
        try:
            torch.cuda.set_device(device)  # the current device is a thread's own
            probe = torch.ones(1, device=torch.device("cuda", device))
            pg.allreduce([probe]).wait()
            if (got := probe.item()) != size:  # .item() waits for the kernel itself
                raise RuntimeError(f"connect all-reduce summed {got:g}, expected {size}")
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=connect, daemon=True, name=f"connect {name}").start()
    if not done.wait(timeout_s):
        abort = getattr(pg, "abort", None)
        if abort is not None:
            threading.Thread(target=abort, daemon=True, name=f"abort {name}").start()
        raise TransportTimeout(f"data-plane group {name}: rank {rank}/{size}: NCCL connect did not finish within "
                               f"{timeout_s:.0f} s (a member never constructed the group)")
    if failure:
        raise TransportTimeout(f"data-plane group {name}: rank {rank}/{size}: NCCL connect failed: "
                               f"{failure[0]}") from failure[0]
