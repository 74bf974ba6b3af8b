"""Weights from the rollout worker's process into vLLM's engine processes, in place, no disk.

vLLM's ``AsyncLLM`` always runs the model in separate processes (engine core, and one worker
per TP rank), while our weight sync delivers HF-named tensors to the rollout worker's process.
This module is both ends of the hand-over:

- ``DarlWorkerExtension`` is mixed into vLLM's GPU worker class (engine arg
  ``worker_extension_cls``), so ``collective_rpc("darl_load_ipc", ...)`` calls it by name on
  every TP rank: no pickled functions, hence no ``VLLM_ALLOW_INSECURE_SERIALIZATION``.
- ``StagingBuffer`` (worker process) packs one chunk of tensors into a flat GPU buffer it owns
  and shares it once by CUDA IPC; the engine side maps it once (cached by handle), slices the
  tensors out as views and calls the model's own ``load_weights`` (which fuses q/k/v and
  gate/up and shards for TP), i.e. what vLLM's IPC weight-transfer engine does, without its
  Ray/HTTP dependencies. ``weight_transfer=copy`` sends the packed bytes through the RPC
  instead (slower; for a worker without CUDA IPC).

The chunk layout (name, dtype, shape, byte offset) is plain lists and strings, which vLLM's
msgpack RPC encodes natively; the IPC handle travels as opaque bytes we pickled ourselves.
"""

from __future__ import annotations

import pickle
from typing import Iterable

import torch

_ALIGN = 16
Entry = tuple[str, str, list[int], int, int]  # name, dtype name, shape, byte offset, nbytes


def layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[Entry], int]:
    """Byte layout of ``named`` in one flat buffer (each tensor 16-byte aligned)."""
    entries, off = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        entries.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), off, nbytes))
        off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return entries, off


def chunks(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """``named`` in lists of at most ``max_bytes`` (a larger tensor goes alone)."""
    chunk, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += nbytes
    if chunk:
        yield chunk


def unpack(buf: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors of ``entries`` inside the flat uint8 ``buf``."""
    out = []
    for name, dtype, shape, off, nbytes in entries:
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} for weight {name!r}")
        out.append((name, buf[off : off + nbytes].view(dt).view(shape)))
    return out


def _pack_into(buf: torch.Tensor, named: list[tuple[str, torch.Tensor]], entries: list[Entry]) -> None:
    for (_, t), (_, _, _, off, nbytes) in zip(named, entries):
        if nbytes:
            buf[off : off + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)


class StagingBuffer:
    """A flat GPU buffer in the rollout worker's process, shared with vLLM by CUDA IPC.

    Grows (and is re-shared) only when a chunk does not fit; ``handle`` is the pickled
    ``rebuild_cuda_tensor`` arguments of the current buffer.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf: torch.Tensor | None = None
        self.handle: bytes = b""

    def stage(self, named: list[tuple[str, torch.Tensor]]) -> list[Entry]:
        """Copy ``named`` into the buffer; returns its layout. The copies are complete on return."""
        from torch.multiprocessing.reductions import reduce_tensor

        entries, size = layout(named)
        if self.buf is None or self.buf.numel() < size:
            self.buf, self.handle = None, b""
            self.buf = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
            _, args = reduce_tensor(self.buf)
            self.handle = pickle.dumps(args)
        _pack_into(self.buf, named, entries)
        torch.cuda.synchronize(self.device)  # another process reads it next
        return entries


def pack_bytes(named: list[tuple[str, torch.Tensor]]) -> tuple[list[Entry], bytes]:
    """``weight_transfer=copy``: the chunk as one host byte string and its layout."""
    entries, size = layout(named)
    buf = torch.zeros(max(size, 1), dtype=torch.uint8)
    _pack_into(buf, [(n, t.cpu()) for n, t in named], entries)
    return entries, buf.numpy().tobytes()


class DarlWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in each engine process.

    Attribute names start with ``darl_`` so that they cannot clash with the worker's own.
    """

    def darl_model(self) -> torch.nn.Module:
        """The worker's model (``get_model`` where the release has it, else the runner's)."""
        get_model = getattr(self, "get_model", None)
        if callable(get_model):
            try:
                return get_model()
            except NotImplementedError:
                pass
        return self.model_runner.model

    def darl_load_ipc(self, handle: bytes, entries: list[Entry]) -> int:
        """Load the tensors of ``entries`` from the rollout worker's shared staging buffer."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        cache = self.__dict__.setdefault("_darl_ipc", {})
        buf = cache.get(handle)
        if buf is None:
            cache.clear()  # the worker grew its buffer: the old one is no longer used
            buf = cache[handle] = rebuild_cuda_tensor(*pickle.loads(handle))
        return self._darl_load(unpack(buf, entries))

    def darl_load_bytes(self, data: bytes, entries: list[Entry]) -> int:
        """Load the tensors of ``entries`` from a host byte string (``weight_transfer=copy``)."""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return self._darl_load(unpack(buf, entries))

    def _darl_load(self, named: list[tuple[str, torch.Tensor]]) -> int:
        model = self.darl_model()
        model.load_weights(weights=named)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the caller reuses its buffer once this returns
        return len(named)
