"""Reading and writing Hugging Face safetensors checkpoints without holding the whole model.

``HFCheckpointReader`` opens every shard's header once (memory-mapped), validates names and
shapes against the ``Qwen3Spec`` up front (so a bad checkpoint fails before any work, with the
file named), then hands out single tensors on demand: each rank reads only its stage's tensors.
``ShardedSafetensorsWriter`` streams ``(name, tensor)`` pairs into ~``max_shard_bytes`` files
plus ``model.safetensors.index.json``, the layout ``from_pretrained`` expects.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable

import torch

from megatron_darl.models.qwen3.config import Qwen3Spec
from megatron_darl.models.qwen3.mapping import hf_tensor_shapes

INDEX_NAME = "model.safetensors.index.json"
# Files next to the weights that a HF model dir needs to be loadable and tokenizable.
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "tokenizer.model",
)


class HFCheckpointReader:
    """Lazy access to the tensors of a HF safetensors checkpoint directory."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        self._files = self._weight_files()
        self._handles = {}
        self._where: dict[str, Path] = {}
        for path in sorted(set(self._files.values()) or self._glob()):
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
                raise ValueError(f"{path}: corrupt safetensors file ({exc})") from None
            self._handles[path] = handle
            self._where.update({k: path for k in keys})

    def _glob(self) -> list[Path]:
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.dir}: no *.safetensors weight files")
        return files

    def _weight_files(self) -> dict[str, Path]:
        index = self.dir / INDEX_NAME
        if not index.is_file():
            return {}
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: corrupt index ({exc!r})") from None
        files = {name: self.dir / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {INDEX_NAME} but missing")
        return files

    def keys(self) -> list[str]:
        return list(self._where)

    def validate(self, spec: Qwen3Spec) -> None:
        """Raise ``ValueError`` naming the tensor and file if any is missing or misshapen."""
        for name, shape in hf_tensor_shapes(spec).items():
            path = self._where.get(name)
            if path is None:
                raise ValueError(f"{self.dir}: tensor {name} missing from the checkpoint")
            found = tuple(self._handles[path].get_slice(name).get_shape())
            if found != shape:
                raise ValueError(f"{path}: tensor {name} has shape {found}, config says {shape}")

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a fresh CPU copy)."""
        path = self._where.get(name)
        if path is None:
            raise KeyError(f"{self.dir}: no tensor {name}")
        return self._handles[path].get_tensor(name)

    def __call__(self, name: str) -> torch.Tensor:
        return self.get(name)


class ShardedSafetensorsWriter:
    """Write tensors into ``model-XXXXX-of-YYYYY.safetensors`` files plus the index."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 * 1024**3, prefix: str = ""):
        self.dir = Path(out_dir)
        self.max_bytes = max_shard_bytes
        self.prefix = prefix  # distinguishes writers of different PP stages in one dir
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        path = self.dir / f"part-{self.prefix}{len(self._written):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[tuple[Path, list[str]]]:
        """Flush; return ``(temporary file, names)`` per written file."""
        self._flush()
        return self._written


def finalize_shards(out_dir: Path, parts: Iterable[tuple[Path, list[str]]], total_bytes: int):
    """Rename temporary part files to HF's ``model-i-of-n`` names and write the index."""
    parts = sorted(parts, key=lambda p: p[0].name)
    n = len(parts)
    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(parts, start=1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        Path(path).rename(out_dir / final)
        weight_map.update({name: final for name in names})
    weight_map = dict(sorted(weight_map.items()))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config/tokenizer files present in ``src`` to ``dst``; return the names copied."""
    copied = []
    for name in HF_SIDE_FILES:
        path = Path(src) / name
        if path.is_file():
            shutil.copy2(path, Path(dst) / name)
            copied.append(name)
    return copied
