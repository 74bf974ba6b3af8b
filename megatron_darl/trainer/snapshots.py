"""Parameter snapshots of past versions, for exact log-prob backfill (``mis.backfill=snapshot``).

D-ARL needs log pi_k(y) for window versions k older than a sample's arrival (DESIGN 4.3). Each
rank keeps, for the last K versions, a copy of *its own* model shard (its TP x PP slice of the
weights, the model dtype: bf16 on GPU) in host memory, pinned on GPU so the copies run at PCIe
bandwidth without staging. To score under version k the trainer swaps the snapshot into the live
parameters, runs the ordinary forward-only log-prob pass and swaps the current weights back
(also through a pinned host buffer, so no extra GPU memory is needed). Optimizer state is never
touched: it lives in the optimizer's own fp32 main params.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class ParamSnapshots:
    """Host copies of one rank's parameters, keyed by weight version."""

    def __init__(self, params: list[torch.Tensor], pin: bool):
        self._params = params  # the live parameters, in a fixed order
        self._pin = pin  # pinned host memory (GPU runs only)
        self._store: dict[int, list[torch.Tensor]] = {}
        self._scratch: list[torch.Tensor] | None = None  # reused for swap-back

    def _host_like(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self._pin)

    @torch.no_grad()
    def take(self, version: int) -> None:
        """Copy the live parameters as ``version`` (reusing the oldest buffers is the caller's
        choice: ``drop`` first to bound memory)."""
        bufs = self._store.get(version) or [self._host_like(p) for p in self._params]
        for buf, p in zip(bufs, self._params):
            buf.copy_(p.detach(), non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()
        self._store[version] = bufs

    def drop(self, version: int) -> None:
        self._store.pop(version, None)

    def keep_last(self, k: int) -> None:
        """Drop all but the ``k`` newest versions."""
        for v in sorted(self._store)[: max(0, len(self._store) - k)]:
            self.drop(v)

    @property
    def versions(self) -> list[int]:
        return sorted(self._store)

    def bytes(self) -> int:
        """Host bytes held by snapshots (scratch excluded)."""
        return sum(t.numel() * t.element_size() for bufs in self._store.values() for t in bufs)

    @contextlib.contextmanager
    def swapped_in(self, version: int) -> Iterator[None]:
        """Run the body with ``version``'s weights in the live parameters, then restore them."""
        if version not in self._store:
            raise ValueError(f"no parameter snapshot of version {version}; have {self.versions}")
        if self._scratch is None:
            self._scratch = [self._host_like(p) for p in self._params]
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
