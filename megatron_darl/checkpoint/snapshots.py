"""Parameter snapshots in a training checkpoint: written with it, restored on resume.

A resumed run needs the trainer's snapshots of the window's older versions
(``trainer.snapshots.ParamSnapshots``): without them it could not backfill versions older than
its first step for K - 1 steps, and the mixture would fall back to nearest-version copies. Each
snapshot older than the current version is written as a model-only ``dist_checkpointing``
checkpoint under ``<ckpt>/snapshots/v<version>`` (the same sharded keys as the model, so it
reloads at any TP/PP), by swapping it into the live parameters for the save; the current version
is the checkpoint's own model. Loading reverses that and restores the live parameters bit for
bit from a snapshot of them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_darl.checkpoint.model_io import chunked_model_state_dict, save_sharded

log = logging.getLogger(__name__)
SNAPSHOT_DIR = "snapshots"


def _version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def save_snapshots(trainer, ckpt_dir: Path) -> list[int]:
    """Write every kept snapshot but the current version's under ``ckpt_dir/snapshots``.

    Collective over all ranks (``dist_checkpointing.save``); returns the versions written.
    """
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
    from megatron.core import dist_checkpointing  # Megatron: deferred, as everywhere outside the trainer's build

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
