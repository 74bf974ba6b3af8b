"""Parameter snapshots of past versions, for exact log-prob backfill (``mis.backfill=snapshot``).

D-ARL needs log pi_k(y) for window versions k older than a sample's arrival (docs/algorithm.md,
section 7). Each rank keeps, for the last K versions, a copy of *its own* model shard (its TP x PP
slice of the weights, the model dtype: bf16 on GPU) in host memory, pinned on GPU so the copies run
at PCIe bandwidth without staging. To score under version k the trainer swaps the snapshot into the
live parameters, runs the ordinary forward-only log-prob pass and swaps the current weights back
(also through a pinned host buffer, so no extra GPU memory is needed). Optimizer state is never
touched: it lives in the optimizer's own fp32 main params.

Checkpoints carry the snapshots (``save_snapshots`` / ``load_snapshots``): without them a resumed
run could not backfill versions older than its first step for K - 1 steps, and the mixture would
silently fall back to nearest-version copies. Each snapshot older than the current version is
written as a model-only ``dist_checkpointing`` checkpoint under ``<ckpt>/snapshots/v<version>``
(the same sharded keys as the model, so it reloads at any TP/PP), by swapping it into the live
parameters for the save; the current version is the checkpoint's own model. Loading reverses
that and restores the live parameters bit for bit from a snapshot of them.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterable, Iterator

import torch

log = logging.getLogger(__name__)
SNAPSHOT_DIR = "snapshots"


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

    def retain(self, versions: Iterable[int]) -> None:
        """Drop every snapshot whose version is not in ``versions`` (the loop's replay window)."""
        keep = set(versions)
        for v in [v for v in self._store if v not in keep]:
            self.drop(v)

    @property
    def versions(self) -> list[int]:
        return sorted(self._store)

    def bytes(self) -> int:
        """Host bytes held by snapshots (scratch excluded)."""
        return sum(t.numel() * t.element_size() for bufs in self._store.values() for t in bufs)

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


def _version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def save_snapshots(trainer, ckpt_dir: Path) -> list[int]:
    """Write every kept snapshot but the current version's under ``ckpt_dir/snapshots``.

    Collective over all ranks (``dist_checkpointing.save``); returns the versions written.
    """
    import torch.distributed as dist

    from megatron_darl.trainer.checkpoint_io import chunked_model_state_dict, save_sharded

    versions = [v for v in trainer.snapshots.versions if v != trainer.version]
    root = Path(ckpt_dir) / SNAPSHOT_DIR
    if trainer.ps.rank == 0:
        for v in versions:
            _version_dir(root, v).mkdir(parents=True)
    dist.barrier()
    for v in versions:
        with trainer.snapshots.swapped_in(v):
            save_sharded(chunked_model_state_dict(trainer.model_chunks), _version_dir(root, v))
    return versions


def load_snapshots(trainer, ckpt_dir: Path) -> list[int]:
    """Restore the snapshots a checkpoint carries, plus the current version's, into the trainer.

    Call after the checkpoint's model is loaded. The live parameters end bit-identical to how
    they started. Returns the versions now kept; a checkpoint without snapshots is logged.
    """
    from megatron.core import dist_checkpointing

    from megatron_darl.trainer.checkpoint_io import chunked_model_state_dict

    snaps = trainer.snapshots
    snaps.take(trainer.version)
    root = Path(ckpt_dir) / SNAPSHOT_DIR
    dirs = sorted(root.glob("v*")) if root.is_dir() else []
    if not dirs:
        log.warning("%s holds no parameter snapshots: backfill of versions before %d will use "
                    "the nearest cached version", ckpt_dir, trainer.version)
    for d in dirs:
        state = dist_checkpointing.load(chunked_model_state_dict(trainer.model_chunks), str(d))
        with torch.no_grad():
            for i, chunk in enumerate(trainer.model_chunks):
                chunk.load_state_dict(state[f"model{i}"])
        snaps.take(int(d.name[1:]))
    snaps.restore(trainer.version)
    return snaps.versions
