"""SHA-256 manifest of a training checkpoint, written once the save is complete, checked at load.

Why: dist_checkpointing trusts the bytes it reads. Unchecked, zeros in a ``.distcp`` shard
resume silently (a model of zeros), 0xFF bytes resume NaN weights that only a rollout worker
notices, much later and under another name ("control-plane store failed (trainer gone?)"), and
a garbage ``common.pt`` surfaces as a bare ``UnicodeDecodeError``. A length check
(``check_shards``) sees none of these.

``write_manifest`` runs after every rank has finished writing (the checkpoint is complete but
not yet renamed from its ``.tmp``): the files are split over the ranks by size, each rank hashes
its share, and rank 0 writes ``checksums.json`` with the size and digest of every file. The digest
is the SHA-256 of the SHA-256s of the file's 64 MiB blocks, hashed by a pool of threads (hashlib
releases the GIL): one trainer rank holds a whole 1.7B run's 24-38 GB, and one SHA-256 stream
(~1.5 GB/s) would take 20 s of the 30 s Slurm gives a cancelled job to checkpoint (``KillWait``).
Manifests of format 1 (one SHA-256 of the whole file, ``block_bytes`` absent) still verify.
``verify_checkpoint`` is the same split at load: every rank agrees on the first problem found
(the file, what is wrong with it), so all ranks refuse the checkpoint together naming it. A
checkpoint without a manifest
(an older format) loads with a warning; the weights are still checked for
NaN/Inf after the load (``nonfinite_parameter``), which catches what its bytes alone cannot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
MANIFEST_NAME = "checksums.json"
FORMAT_VERSION = 2  # 1: one SHA-256 of each whole file; 2: SHA-256 of its blocks' SHA-256s
BLOCK_BYTES = 64 << 20  # a file's blocks, hashed in parallel
_CHUNK = 8 << 20  # bytes hashed per read


def checkpoint_files(ckpt_dir: Path) -> list[str]:
    """Every file under ``ckpt_dir`` except the manifest, as sorted POSIX relative paths."""
    root = Path(ckpt_dir)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST_NAME)


def _sha256_range(path: Path, start: int, length: int | None):
    """SHA-256 of ``length`` bytes of the file from ``start`` (None: to its end)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while (chunk := f.read(_CHUNK if left is None else min(_CHUNK, left))):
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest


def hash_threads() -> int:
    """Threads a rank hashes with: the cores it may use, at most 8 (reads saturate before)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


def file_digests(root: Path, entries: dict[str, tuple[int, int]]) -> dict[str, str]:
    """``{name: digest}`` for files of ``{name: (bytes, block_bytes)}`` under ``root``: with
    ``block_bytes`` the SHA-256 of the concatenated SHA-256s of its blocks (format 2), with 0 one
    SHA-256 of the whole file (format 1); every block of every file on one pool of threads.

    Raises:
        OSError: a file that cannot be read.
    """
    jobs = [(name, start, block or None) for name, (size, block) in entries.items()
            for start in (range(0, max(size, 1), block) if block else (0,))]
    with ThreadPoolExecutor(hash_threads()) as pool:
        parts = list(pool.map(lambda job: _sha256_range(root / job[0], job[1], job[2]), jobs))
    digests = {name: hashlib.sha256() for name, (_, block) in entries.items() if block}
    whole: dict[str, str] = {}
    for (name, _, block), part in zip(jobs, parts):
        if block:
            digests[name].update(part.digest())
        else:
            whole[name] = part.hexdigest()
    return whole | {name: digest.hexdigest() for name, digest in digests.items()}


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
        mine = file_digests(root, {name: (sizes[name], BLOCK_BYTES) for name in share(sizes, rank, world)})
        problem = ""
    except OSError as exc:
        mine, problem = {}, f"hashing the checkpoint's files: {exc}"
    digests: dict[str, str] = {}
    for part, why in _gather((mine, problem)):
        digests.update(part)
        problem = problem or why
    if rank == 0 and not problem:
        files = {name: {"bytes": sizes[name], "sha256": digests[name], "block_bytes": BLOCK_BYTES}
                 for name in sorted(sizes)}
        payload = {"format_version": FORMAT_VERSION, "algorithm": "sha256-of-block-sha256s", "files": files}
        path, tmp = root / MANIFEST_NAME, root / f"{MANIFEST_NAME}.tmp"
        try:
            tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
            tmp.rename(path)
        except OSError as exc:
            problem = f"writing {path}: {exc}"
    return first_problem(problem)


def read_manifest(ckpt_dir: Path) -> dict[str, dict] | None:
    """``{relative path: {"bytes", "sha256"[, "block_bytes"]}}``, None without a manifest.

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
            if not isinstance(entry.get("block_bytes", 0), int) or entry.get("block_bytes", 0) < 0:
                raise ValueError(f"entry {name!r} has block_bytes {entry.get('block_bytes')!r}")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a checksum manifest ({type(exc).__name__}: {exc})") from None
    return files


def check_files(ckpt_dir: Path, files: dict[str, dict], names: list[str]) -> str:
    """The first of ``names`` that is missing or of another size, else the first of another
    digest ("" if none); the digests are computed in parallel (``file_digests``)."""
    root = Path(ckpt_dir)
    for name in names:
        path, want = root / name, int(files[name]["bytes"])
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want:
            what = "truncated" if size < want else "longer than written"
            return f"{path} is {what} ({size} bytes, {MANIFEST_NAME} says {want})"
    got = file_digests(root, {name: (int(files[name]["bytes"]), int(files[name].get("block_bytes", 0)))
                              for name in names})
    for name in names:
        want = str(files[name]["sha256"])
        if got[name] != want:
            return (f"{root / name} does not match its checksum (sha256 {got[name][:12]}..., "
                    f"{MANIFEST_NAME} says {want[:12]}...)")
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
