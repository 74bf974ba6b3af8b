"""Room on disk for a training checkpoint: estimated and agreed on before the write, and a write
that failed anyway reported with the disk's state.

Why: a full disk is the common way a long run loses its checkpoint, and megatron-core reports it
badly. Its torch_dist writer turns ``[Errno 28] No space left on device`` into
``RuntimeError: Worker failure: An error is caught while starting worker 0`` (the OSError itself
only reaches a logger), half a checkpoint stays behind in ``<dir>.tmp``, and the user learns
neither which filesystem filled nor that the earlier checkpoints are still fine (twelve D-ARL
runs of the variant study sharing one 64 GiB device disk fill it: docs/results.md).

So, before anything is written, every rank estimates the bytes its share of the checkpoint takes
(from the parameters it holds; ``checkpoint_bytes``), and the ranks agree on the sum and on the
least free space any of them sees (``check_room``: two tiny all-reduces, so all raise together or
none does: a rank alone would hang the others' collectives). A checkpoint that cannot fit is
refused with ``NoRoomForCheckpoint`` naming the directory, both numbers and what to do; nothing
is written. The estimate is of the tensor payload; metadata files are small beside it. Other
writers can still fill the disk during the write (twelve runs share one disk): then
``write_failed`` names the checkpoint, the cause, the free space left and whether the disk is the
likely culprit; the caller removes the partial ``.tmp`` directory. Earlier checkpoints are never
touched by either path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist


class CheckpointFailed(RuntimeError):
    """A checkpoint was not written; earlier checkpoints are intact."""


class NoRoomForCheckpoint(CheckpointFailed):
    """Refused before writing: the estimate exceeds the free space."""


def gib(n: float) -> str:
    """Bytes for a person: GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def existing_ancestor(path: Path) -> Path:
    """The nearest directory on ``path``'s way up that exists (its filesystem is the target's)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_ancestor(path)).free


def checkpoint_bytes(trainer, snapshots: int) -> int:
    """This rank's share of a checkpoint's tensor bytes.

    The model shard (and each of ``snapshots`` older versions, same dtype) is replicated over DP,
    and dist_checkpointing writes each replica once, so a rank writes 1/DP of it. The distributed
    optimizer's state is sharded over DP: Adam's two fp32 moments and the fp32 main params, which
    it writes even for an fp32 model (measured: 16.0 tensor bytes per fp32 parameter, 18.2 with
    the files' own overhead on the 165k-parameter test model; the estimate is ~12 % under there
    and closer on real sizes, where the per-tensor overhead is small beside the payload).
    """
    params = [p for chunk in trainer.model_chunks for p in chunk.parameters()]
    model = sum(p.numel() * p.element_size() for p in params)
    optimizer = 12 * sum(p.numel() for p in params)
    return (model * (1 + snapshots) + optimizer) // max(trainer.ps.dp_size, 1)


def _world_reduce(value: float, op) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def agreed_room(trainer, final: Path, snapshots: int) -> tuple[int, int]:
    """Collective: (the checkpoint's estimated bytes over all ranks, the least free bytes any rank
    sees where it goes); the same numbers on every rank."""
    need = _world_reduce(float(checkpoint_bytes(trainer, snapshots)), dist.ReduceOp.SUM)
    free = _world_reduce(float(free_bytes(final.parent)), dist.ReduceOp.MIN)
    return int(need), int(free)


def check_room(trainer, final: Path, snapshots: int) -> int:
    """Collective: raise ``NoRoomForCheckpoint`` on every rank when the checkpoint cannot fit.

    Returns the agreed estimate in bytes (for the message of a write that fails later)."""
    need, free = agreed_room(trainer, final, snapshots)
    if need > free:
        raise NoRoomForCheckpoint(
            f"checkpoint {final} not written: it needs about {gib(need)} and the filesystem of "
            f"{existing_ancestor(final.parent)} has {gib(free)} free. Nothing was written; earlier "
            "checkpoints are untouched. Free space there, or keep fewer checkpoints "
            "(loop.keep_checkpoints=N keeps the newest N)")
    return int(need)


def write_failed(final: Path, need: int, exc: BaseException | None) -> CheckpointFailed:
    """The error for a write that failed on some rank (``exc``: this rank's, None elsewhere)."""
    free = free_bytes(final.parent)
    lines = str(exc).strip().splitlines() if exc is not None else []
    cause = (f"{type(exc).__name__}: {lines[-1] if lines else ''}" if exc is not None  # megatron's: a traceback
             else "another rank's write failed")
    disk = (f"; the disk is the likely cause: {gib(free)} free, under the ~{gib(need)} the checkpoint "
            "needs (other writers share it?)" if free < need else f"; {gib(free)} free")
    return CheckpointFailed(
        f"checkpoint {final} not written ({cause}){disk} on the filesystem of "
        f"{existing_ancestor(final.parent)}. The partial write is removed; earlier checkpoints are untouched")


def any_rank(flag: bool) -> bool:
    """Collective: True on every rank when ``flag`` is True on any."""
    return bool(_world_reduce(float(flag), dist.ReduceOp.MAX))
