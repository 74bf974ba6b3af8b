"""Framing of a ``SampleGroup`` as two flat tensors (int64 and float32), one uint8 buffer, or bytes.

Why two tensors: every field of a group is either an integer (ids, lengths, versions) or a
float32 (behavior log-probs, rewards), so a group crosses any transport as one contiguous uint8
buffer (``to_buffer``: a 16-byte size prefix, the ints, the floats) with no pickling: a
point-to-point gloo/NCCL send on the data plane, or bytes in a store key. Float32 log-probs round-trip bitwise: they are the behavior density and are never
recomputed.

Layout of ``ints`` (int64): ``[MAGIC, VERSION, group_id, prompt_id, worker_id, worker_index,
seq, start_version, started_index, generation, G, (sample_id, P, T, truncated) * G, rewards (G,
float64 bits), prompt ids..., response ids..., token versions...]``; ``floats`` (float32):
behavior log-probs. Rewards keep their float64 value exactly. ``worker_index`` (format 2) is the
group's ordinal among its worker's groups: the trainer counts each worker's groups from it for a
resume. ``generation`` (format 3) is the worker generation that reserved the group's start: the
hub refuses a fenced one's groups (``staleness.py``).

Host-side copies (framing, splitting) go through numpy, single-threaded: a ``torch.cat`` of a
megabyte runs on the process's intra-op pool, and with one pool per process on a many-core
host (the launcher gives each process cores / processes threads) those pools fight: measured on
2x H200 (32 cores, 5 processes, 4 workers -> 1 hub), the channel did 92 MB/s with torch's default
threads, 566 MB/s with 5 per process and 762 MB/s with 1. Several frames concatenated (one
data-plane transfer, ``split_frames``) are self-delimiting through their size prefixes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from megatron_darl.samples import Sample, SampleGroup

MAGIC = 0x44415231  # "DAR1"
FORMAT_VERSION = 3  # 2: worker_index in the head; 3: the worker's generation
_HEAD = 11  # ints before the per-sample table
_PER_SAMPLE = 4


@dataclass(frozen=True)
class GroupMeta:
    """Channel bookkeeping that travels with a group."""

    seq: int  # per (worker, hub) sequence number: the exactly-once key
    start_version: int  # published version the worker read when it started the group
    started_index: int  # global groups_started count taken by this group (staleness bound)
    generation: int = 0  # the worker generation that reserved its start (0: a gate keeping no count)


@dataclass
class ReceivedGroup:
    """What a hub hands to the loop: the group and its channel bookkeeping."""

    group: SampleGroup  # the samples, exactly as the worker sent them
    meta: GroupMeta  # sequence number and staleness bookkeeping


@dataclass
class GroupFrame:
    """A group as two flat tensors."""

    ints: torch.Tensor  # (I,) int64
    floats: torch.Tensor  # (F,) float32

    def to_buffer(self) -> torch.Tensor:
        """``(B,)`` uint8: the sizes (two little-endian uint64), the ints, the floats."""
        sizes = np.frombuffer(struct.pack("<QQ", self.ints.numel(), self.floats.numel()), dtype=np.uint8)
        return torch.from_numpy(np.concatenate([sizes, _bytes_of(self.ints), _bytes_of(self.floats)]))

    @staticmethod
    def from_buffer(buf: torch.Tensor) -> "GroupFrame":
        """Inverse of ``to_buffer`` (a host uint8 tensor); ``ValueError`` on a truncated one."""
        if buf.numel() != (size := frame_size(buf)):
            raise ValueError(f"truncated group frame: {buf.numel()} bytes, its prefix announces {size}")
        n_int = struct.unpack("<Q", buf[:8].numpy().tobytes())[0]
        raw = buf.numpy()
        ints = torch.from_numpy(raw[16 : 16 + 8 * n_int].copy().view(np.int64))
        floats = torch.from_numpy(raw[16 + 8 * n_int :].copy().view(np.float32))
        return GroupFrame(ints=ints, floats=floats)

    def to_bytes(self) -> bytes:
        return self.to_buffer().numpy().tobytes()

    @staticmethod
    def from_bytes(data: bytes) -> "GroupFrame":
        return GroupFrame.from_buffer(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def frame_size(buf: torch.Tensor, offset: int = 0) -> int:
    """Bytes of the frame that starts at ``offset`` of ``buf`` (read from its size prefix)."""
    if buf.numel() - offset < 16:
        raise ValueError(f"truncated group frame at byte {offset}: {buf.numel() - offset} bytes left")
    n_int, n_float = struct.unpack("<QQ", buf[offset : offset + 16].numpy().tobytes())
    return 16 + 8 * n_int + 4 * n_float


def split_frames(buf: torch.Tensor, count: int) -> list[GroupFrame]:
    """The ``count`` frames concatenated in ``buf`` (a host uint8 tensor); ``ValueError`` when
    their sizes do not add up to exactly ``buf``."""
    frames, off = [], 0
    for _ in range(count):
        n = frame_size(buf, off)
        if off + n > buf.numel():
            raise ValueError(f"truncated group frame at byte {off}: {n} bytes announced, "
                             f"{buf.numel() - off} left")
        frames.append(GroupFrame.from_buffer(buf[off : off + n]))
        off += n
    if off != buf.numel():
        raise ValueError(f"{buf.numel() - off} bytes after the {count} frames of a transfer")
    return frames


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy().view(np.uint8)


def frame_group(group: SampleGroup, meta: GroupMeta) -> GroupFrame:
    """Pack ``group`` and ``meta`` into a ``GroupFrame``."""
    samples = group.samples
    head = [MAGIC, FORMAT_VERSION, group.group_id, group.prompt_id, group.worker_id, group.worker_index,
            meta.seq, meta.start_version, meta.started_index, meta.generation, len(samples)]
    table = []
    for s in samples:
        table += [s.sample_id, s.prompt_ids.numel(), s.num_tokens, int(s.truncated)]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64).view(torch.int64)
    parts = [torch.tensor(head + table, dtype=torch.int64), rewards]
    parts += [s.prompt_ids for s in samples] + [s.response_ids for s in samples]
    parts += [s.token_versions for s in samples]
    floats = [s.behavior_logprobs for s in samples]
    return GroupFrame(ints=host_cat(parts, torch.int64), floats=host_cat(floats, torch.float32))


def host_cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """1-D host ``dtype`` tensor of ``parts`` (any shapes, host or device) end to end, copied by
    numpy on one thread (module docstring); a single host part of that dtype is not copied."""
    flat = [p.detach().to("cpu", dtype).reshape(-1) for p in parts]
    if len(flat) == 1:
        return flat[0]
    return torch.from_numpy(np.concatenate([torch.empty(0, dtype=dtype).numpy()] + [f.numpy() for f in flat]))


def unframe_group(frame: GroupFrame) -> ReceivedGroup:
    """Inverse of ``frame_group``; raises ``ValueError`` on a malformed frame."""
    ints, floats = frame.ints, frame.floats
    if ints.numel() < _HEAD or int(ints[0]) != MAGIC or int(ints[1]) != FORMAT_VERSION:
        raise ValueError("not a sample-group frame (bad magic or format version)")
    head = ints[:_HEAD].tolist()
    group_id, prompt_id, worker_id, worker_index, seq, start_version, started_index, generation, g = head[2:]
    table = ints[_HEAD : _HEAD + _PER_SAMPLE * g].view(g, _PER_SAMPLE).tolist() if g else []
    lens_p = [row[1] for row in table]
    lens_t = [row[2] for row in table]
    expect_i = _HEAD + _PER_SAMPLE * g + g + sum(lens_p) + 2 * sum(lens_t)
    if ints.numel() != expect_i or floats.numel() != sum(lens_t):
        raise ValueError(f"group {group_id}: frame sizes do not match its sample table")
    off = _HEAD + _PER_SAMPLE * g
    rewards = ints[off : off + g].numpy().view(np.float64).tolist()
    prompts, off = _split(ints, off + g, lens_p)
    responses, off = _split(ints, off, lens_t)
    versions, _ = _split(ints, off, lens_t)
    logprobs, _ = _split(floats, 0, lens_t)
    samples = [
        Sample(sample_id=row[0], prompt_ids=p, response_ids=r, behavior_logprobs=lp,
               token_versions=v, reward=rewards[i], truncated=bool(row[3]))
        for i, (row, p, r, v, lp) in enumerate(zip(table, prompts, responses, versions, logprobs))
    ]
    group = SampleGroup(group_id=group_id, prompt_id=prompt_id, samples=samples, worker_id=worker_id,
                        worker_index=worker_index)
    return ReceivedGroup(group=group, meta=GroupMeta(seq, start_version, started_index, generation))


def _split(t: torch.Tensor, off: int, lengths: list[int]) -> tuple[list[torch.Tensor], int]:
    raw, out = t.numpy(), []
    for n in lengths:
        out.append(torch.from_numpy(raw[off : off + n].copy()))
        off += n
    return out, off
