"""SHA-256 manifest of a training checkpoint, written once the save is complete, checked at load.

Why: dist_checkpointing trusts the bytes it reads. Unchecked, zeros in a ``.distcp`` shard
resume silently (a model of zeros), 0xFF bytes resume NaN weights that only a rollout worker
notices, much later and under another name ("control-plane store failed (trainer gone?)"), and
a garbage ``common.pt`` surfaces as a bare ``UnicodeDecodeError``. A length check
(``check_shards``) sees none of these.

``write_manifest`` runs after every rank has finished writing (the checkpoint is complete but
not yet renamed from its ``.tmp``): the files are split over the ranks by size, each rank hashes
its share (hashlib releases the GIL; on a real cluster the ranks read in parallel), and rank 0
writes ``checksums.json`` with the size and SHA-256 of every file. ``verify_checkpoint`` is the
same split at load: every rank agrees on the first problem found (the file, what is wrong with
it), so all ranks refuse the checkpoint together naming it. A checkpoint without a manifest
(an older format) loads with a warning; the weights are still checked for
NaN/Inf after the load (``nonfinite_parameter``), which catches what its bytes alone cannot.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
MANIFEST_NAME = "checksums.json"
FORMAT_VERSION = 1
_CHUNK = 8 << 20  # bytes hashed per read


def checkpoint_files(ckpt_dir: Path) -> list[str]:
    """Every file under ``ckpt_dir`` except the manifest, as sorted POSIX relative paths."""
    root = Path(ckpt_dir)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST_NAME)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's files: largest first, each to the least loaded rank (same on every rank)."""
    loads, mine = [0] * world, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = loads.index(min(loads))
        loads[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj):
    """Every rank's ``obj`` (one process: ``[obj]``)."""
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def first_problem(problem: str) -> str:
    """Collective: the first non-empty ``problem`` over the ranks (rank order), "" when none."""
    return next((p for p in _gather(problem) if p), "")


def write_manifest(ckpt_dir: Path) -> str:
    """Collective: hash the finished checkpoint's files, rank 0 writes ``checksums.json``.

    Returns "" when it is written, else why not (the same line on every rank)."""
    root = Path(ckpt_dir)
    rank, world = _rank_world()
    sizes: dict[str, int] = {}
    try:
        sizes = {name: (root / name).stat().st_size for name in checkpoint_files(root)}
        mine, problem = {name: sha256_file(root / name) for name in share(sizes, rank, world)}, ""
    except OSError as exc:
        mine, problem = {}, f"hashing the checkpoint's files: {exc}"
    digests: dict[str, str] = {}
    for part, why in _gather((mine, problem)):
        digests.update(part)
        problem = problem or why
    if rank == 0 and not problem:
        files = {name: {"bytes": sizes[name], "sha256": digests[name]} for name in sorted(sizes)}
        payload = {"format_version": FORMAT_VERSION, "algorithm": "sha256", "files": files}
        path, tmp = root / MANIFEST_NAME, root / f"{MANIFEST_NAME}.tmp"
        try:
            tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
            tmp.rename(path)
        except OSError as exc:
            problem = f"writing {path}: {exc}"
    return first_problem(problem)


def read_manifest(ckpt_dir: Path) -> dict[str, dict] | None:
    """``{relative path: {"bytes", "sha256"}}``, None without a manifest.

    Raises:
        ValueError: naming the manifest when it is not one.
    """
    path = Path(ckpt_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        files = data["files"]
        if data.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"format_version {data.get('format_version')!r} is newer than this code's")
        if not isinstance(files, dict):
            raise ValueError("'files' is not a mapping")
        for name, entry in files.items():
            if not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
                raise ValueError(f"entry {name!r} lacks bytes or sha256")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a checksum manifest ({type(exc).__name__}: {exc})") from None
    return files


def check_files(ckpt_dir: Path, files: dict[str, dict], names: list[str]) -> str:
    """The first of ``names`` that is missing, of another size or another SHA-256 ("" if none)."""
    root = Path(ckpt_dir)
    for name in names:
        path, want = root / name, files[name]
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != int(want["bytes"]):
            what = "truncated" if size < int(want["bytes"]) else "longer than written"
            return f"{path} is {what} ({size} bytes, {MANIFEST_NAME} says {int(want['bytes'])})"
        got = sha256_file(path)
        if got != want["sha256"]:
            return (f"{path} does not match its checksum (sha256 {got[:12]}..., "
                    f"{MANIFEST_NAME} says {str(want['sha256'])[:12]}...)")
    return ""


def verify_checkpoint(ckpt_dir: Path) -> str:
    """Collective: "" when every file matches ``checksums.json``, else the first problem (the
    same line on every rank). A checkpoint without a manifest passes with a warning."""
    rank, world = _rank_world()
    try:
        files = read_manifest(ckpt_dir)
        problem = ""
    except ValueError as exc:
        files, problem = None, str(exc)
    if files is None and not problem:
        if rank == 0:
            log.warning("%s has no %s (written before checksums were kept): its files are not "
                        "verified; its weights are still checked for NaN/Inf", ckpt_dir, MANIFEST_NAME)
        return ""
    if not problem:
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
        problem = check_files(ckpt_dir, files, share(sizes, rank, world))
    return first_problem(problem)


@torch.no_grad()
def nonfinite_parameter(named_params) -> str:
    """The first ``(name, tensor)`` holding NaN or Inf, as "name (k of n values are nan/inf)"."""
    for name, p in named_params:
        bad = ~torch.isfinite(p.detach())
        if bool(bad.any()):
            count = int(bad.sum())
            kinds = [k for k, f in (("nan", torch.isnan), ("inf", torch.isinf)) if bool(f(p.detach()).any())]
            return f"{name} ({count} of {p.numel()} values are {'/'.join(kinds)})"
    return ""
