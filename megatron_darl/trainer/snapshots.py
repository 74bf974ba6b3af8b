"""Parameter snapshots of past versions, for exact log-prob backfill (``mis.backfill=snapshot``).

D-ARL needs log pi_k(y) for window versions k older than a sample's arrival (docs/algorithm.md,
section 7). Each rank keeps, for the last K versions, a copy of *its own* model shard (its TP x PP
slice of the weights, the model dtype: bf16 on GPU). Where the copies live decides what a backfill costs:

    resident  on the parameters' device (``trainer.snapshots: device``, and always on CPU): to
              score under version k the live parameters point at the snapshot's tensors for the
              pass (``param.data`` swapped, no copy) and back; backfill is a forward pass and
              nothing else
    host      pinned host memory (``host``): the snapshot is copied in through PCIe and the live
              weights copied out and back, three full-model copies per backfilled version

``auto`` (the default) keeps a snapshot resident while the device keeps ``headroom`` of its
memory free after it at the run's peak (``room_for_snapshot``) and on the host otherwise; a run
logs where its snapshots went. The peak is the allocator's highest *allocated* bytes, not what it
holds reserved: the cache keeps the blocks of the largest log-prob pass, and counted as used they
would leave no room for a 1.7B snapshot on an H200 with 100 GiB idle in that cache. Taking a
snapshot is one device-to-device copy per step, into the buffers of the version that left the
window. Optimizer state is never touched: it lives in the optimizer's own fp32 main params.

Checkpoints carry the snapshots (``megatron_darl.checkpoint.snapshots``), so a resumed run
backfills exactly from its first step.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Iterator

import torch

log = logging.getLogger(__name__)


PLACEMENTS = ("auto", "device", "host")


def room_for_snapshot(free: int, total: int, reserved: int, peak_allocated: int, nbytes: int,
                      headroom: float) -> bool:
    """Whether a device keeps ``headroom`` of ``total`` free at its peak with one more resident
    snapshot of ``nbytes``: this process at its peak (``peak_allocated``, the train step's and
    log-prob passes' highest) plus the snapshot, plus what others hold on the device (neither
    free nor this process's allocator: other processes, the CUDA context)."""
    others = total - free - reserved
    return others + peak_allocated + nbytes <= (1.0 - headroom) * total


class ParamSnapshots:
    """Copies of one rank's parameters, keyed by weight version."""

    def __init__(self, params: list[torch.Tensor], pin: bool, placement: str = "auto",
                 headroom: float = 0.15):
        if placement not in PLACEMENTS:
            raise ValueError(f"trainer.snapshots={placement!r}: use one of {PLACEMENTS}")
        self._params = params  # the live parameters, in a fixed order
        self._pin = pin  # the parameters are on a GPU: host copies are pinned
        self._placement = placement if pin else "device"  # on CPU the device is the host
        self._headroom = headroom  # auto: device memory share left free after a resident snapshot
        self._store: dict[int, list[torch.Tensor]] = {}
        self._spare: list[torch.Tensor] | None = None  # buffers of the last dropped version
        self._scratch: list[torch.Tensor] | None = None  # host copy of the live weights (host swap)
        self._logged: set[bool] = set()

    def _nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params)

    def _resident_next(self) -> bool:
        """Whether the next new snapshot goes on the parameters' device."""
        if self._placement != "auto":
            return self._placement == "device"
        device = self._params[0].device
        free, total = torch.cuda.mem_get_info(device)
        return room_for_snapshot(free, total, torch.cuda.memory_reserved(device),
                                 torch.cuda.max_memory_allocated(device), self._nbytes(),
                                 self._headroom)

    def _buffers(self) -> list[torch.Tensor]:
        if self._spare is not None:
            bufs, self._spare = self._spare, None
            return bufs
        resident = self._resident_next()
        if resident not in self._logged:
            self._logged.add(resident)
            log.info("parameter snapshots of %.2f GiB each kept %s", self._nbytes() / 2**30,
                     "on the device (backfill swaps no weights)" if resident or not self._pin
                     else "in pinned host memory (the device lacks room; backfill copies weights)")
        if resident:
            return [torch.empty_like(p) for p in self._params]
        return [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self._pin)
                for p in self._params]

    def _is_resident(self, version: int) -> bool:
        return self._store[version][0].device == self._params[0].device

    @torch.no_grad()
    def take(self, version: int) -> None:
        """Copy the live parameters as ``version`` (``retain``/``drop`` first to reuse the
        buffers of a version that left the window)."""
        bufs = self._store.get(version) or self._buffers()
        for buf, p in zip(bufs, self._params):
            buf.copy_(p.detach(), non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()
        self._store[version] = bufs

    def drop(self, version: int) -> None:
        bufs = self._store.pop(version, None)
        if bufs is not None:
            self._spare = bufs

    def retain(self, versions: Iterable[int]) -> None:
        """Drop every snapshot whose version is not in ``versions`` (the loop's replay window)."""
        keep = set(versions)
        for v in [v for v in self._store if v not in keep]:
            self.drop(v)

    @property
    def versions(self) -> list[int]:
        return sorted(self._store)

    def bytes(self) -> int:
        """Bytes held by snapshots (spare and scratch buffers excluded)."""
        return sum(t.numel() * t.element_size() for bufs in self._store.values() for t in bufs)

    def resident_versions(self) -> list[int]:
        """Versions whose snapshot lives on the parameters' device."""
        return [v for v in self.versions if self._is_resident(v)]

    @torch.no_grad()
    def restore(self, version: int) -> None:
        """Copy ``version``'s snapshot into the live parameters (they become that version)."""
        if version not in self._store:
            raise ValueError(f"no parameter snapshot of version {version}; have {self.versions}")
        for snap, p in zip(self._store[version], self._params):
            p.copy_(snap, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def swapped_in(self, version: int) -> Iterator[None]:
        """Run the body with ``version``'s weights in the live parameters, then restore them.

        A resident snapshot is swapped by pointer (``param.data``): no copy, and the live
        tensors are back untouched. A host snapshot is copied in, the live weights through a
        host buffer and back."""
        if version not in self._store:
            raise ValueError(f"no parameter snapshot of version {version}; have {self.versions}")
        if self._is_resident(version):
            live = [p.data for p in self._params]
            for snap, p in zip(self._store[version], self._params):
                p.data = snap
            try:
                yield
            finally:
                for data, p in zip(live, self._params):
                    p.data = data
            return
        if self._scratch is None:
            self._scratch = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self._pin)
                             for p in self._params]
        with torch.no_grad():
            for buf, p in zip(self._scratch, self._params):
                buf.copy_(p.detach(), non_blocking=self._pin)
            for snap, p in zip(self._store[version], self._params):
                p.copy_(snap, non_blocking=self._pin)
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, p in zip(self._scratch, self._params):
                    p.copy_(buf, non_blocking=self._pin)
                if self._pin:
                    torch.cuda.synchronize()
