"""Weight-sync buckets: many HF-named tensors packed into one flat byte buffer, and back.

One collective (or one CUDA IPC handle) per ~1 GiB instead of one per tensor, whatever the
dtypes: each tensor sits 16-byte aligned in a uint8 buffer, described by a small JSON header
(``BucketEntry``) that travels through the control store; the receiver views the tensors back
in place, without copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

ALIGN = 16  # byte alignment of every tensor in a bucket


@dataclass
class BucketEntry:
    """Where one tensor sits in a bucket's byte buffer."""

    name: str  # HF parameter name
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: list[int]  # full tensor shape
    offset: int  # byte offset in the bucket buffer (16-byte aligned)
    nbytes: int  # bytes of the tensor


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight bucket header")
    return dtype


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += _aligned(nbytes)
    if bucket:
        yield bucket


def layout(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[BucketEntry], int]:
    """Where each tensor of the bucket goes in one flat buffer, and the buffer's size in bytes."""
    entries, off = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        entries.append(BucketEntry(name, str(t.dtype).removeprefix("torch."), list(t.shape), off, nbytes))
        off += _aligned(nbytes)
    return entries, max(off, 1)


def pack_into(buf: torch.Tensor, bucket: list[tuple[str, torch.Tensor]], entries: list[BucketEntry]) -> None:
    """Copy the bucket's tensors into ``buf`` (uint8, at least the layout's size) at their offsets."""
    for e, (_, t) in zip(entries, bucket):
        if e.nbytes:
            buf[e.offset : e.offset + e.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))


def pack(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[list[BucketEntry], torch.Tensor]:
    """The bucket's entries and one new uint8 buffer on ``device`` holding every tensor's bytes."""
    entries, size = layout(bucket)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    pack_into(buf, bucket, entries)
    return entries, buf


def unpack(entries: list[BucketEntry], buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors into ``buf`` (no copies)."""
    return [(e.name, buf[e.offset : e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)) for e in entries]
