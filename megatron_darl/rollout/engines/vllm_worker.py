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

The chunk layout is the weight sync's own (``transport.buckets``) as plain lists, and the IPC
handle is ``transport.cuda_ipc``'s JSON-able dict: vLLM's msgpack RPC encodes both natively, and
nothing is pickled.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_darl.transport.buckets import BucketEntry, layout, pack_into, unpack
from megatron_darl.transport.cuda_ipc import open_shared, share

Entry = list  # a BucketEntry as a plain list (name, dtype, shape, offset, nbytes): msgpack-native


def _entries(plain: list[Entry]) -> list[BucketEntry]:
    return [BucketEntry(*e) for e in plain]


def _plain(entries: list[BucketEntry]) -> list[Entry]:
    return [[e.name, e.dtype, e.shape, e.offset, e.nbytes] for e in entries]


class StagingBuffer:
    """A flat GPU buffer in the rollout worker's process, shared with vLLM by CUDA IPC.

    Grows (and is re-shared) only when a chunk does not fit; ``handle`` is the JSON-able CUDA IPC
    handle of the current buffer (``transport.cuda_ipc``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf: torch.Tensor | None = None
        self.handle: dict[str, Any] = {}

    def stage(self, named: list[tuple[str, torch.Tensor]]) -> list[Entry]:
        """Copy ``named`` into the buffer; returns its layout. The copies are complete on return."""
        entries, size = layout(named)
        if self.buf is None or self.buf.numel() < size:
            self.buf, self.handle = None, {}
            self.buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.handle = share(self.buf)
        pack_into(self.buf, named, entries)
        torch.cuda.synchronize(self.device)  # another process reads it next
        return _plain(entries)


def pack_bytes(named: list[tuple[str, torch.Tensor]]) -> tuple[list[Entry], bytes]:
    """``weight_transfer=copy``: the chunk as one host byte string and its layout."""
    entries, size = layout(named)
    buf = torch.zeros(size, dtype=torch.uint8)
    pack_into(buf, [(n, t.cpu()) for n, t in named], entries)
    return _plain(entries), buf.numpy().tobytes()


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

    def darl_load_ipc(self, handle: dict[str, Any], entries: list[Entry]) -> int:
        """Load the tensors of ``entries`` from the rollout worker's shared staging buffer."""
        cache = self.__dict__.setdefault("_darl_ipc", {})
        key = (handle["handle"], handle["storage_offset"])
        buf = cache.get(key)
        if buf is None:
            cache.clear()  # the worker grew its buffer: the old one is no longer used
            buf = cache[key] = open_shared(handle)
        return self._darl_load(unpack(_entries(entries), buf))

    def darl_load_bytes(self, data: bytes, entries: list[Entry]) -> int:
        """Load the tensors of ``entries`` from a host byte string (``weight_transfer=copy``)."""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return self._darl_load(unpack(_entries(entries), buf))

    def _darl_load(self, named: list[tuple[str, torch.Tensor]]) -> int:
        model = self.darl_model()
        model.load_weights(weights=named)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the caller reuses its buffer once this returns
        return len(named)
