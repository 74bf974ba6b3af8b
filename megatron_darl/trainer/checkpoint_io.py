"""Model checkpoints in ``megatron.core.dist_checkpointing`` format plus ``megatron_darl.json``.

A checkpoint directory holds the dist_checkpointing files (global tensors, reloadable at any
TP/PP), ``megatron_darl.json`` (how to rebuild the model: HF config, padded vocab, dtype; other
tools detect a Megatron checkpoint dir by this file name) and the HF ``config.json``/tokenizer
files, so ``AutoTokenizer.from_pretrained(dir)`` works and the checkpoint converts back to HF.

Keys are always written with Megatron's *local*-layer names: a model built with Transformer
Engine layers (whose input norms live inside the fused linears) is mapped to the same keys, so
checkpoints move between TE and non-TE machines.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

METADATA_NAME = "megatron_darl.json"
FORMAT_VERSION = 1
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclass
class CheckpointMetadata:
    """Contents of ``megatron_darl.json``."""

    hf_config: dict[str, Any]  # the HF config.json this model was built from
    padded_vocab_size: int  # embedding rows in the checkpoint (vocab padded for TP)
    dtype: str  # parameter dtype of the stored tensors: "float32" | "bfloat16" | "float16"
    saved_tp: int  # layout the checkpoint was written at (it reloads at any TP/PP)
    saved_pp: int
    model_family: str = "qwen3"
    format: str = "megatron_darl"
    format_version: int = FORMAT_VERSION
    megatron_core_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # trainer state (step, version, ...)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def write_metadata(ckpt_dir: str | Path, meta: CheckpointMetadata) -> Path:
    path = Path(ckpt_dir) / METADATA_NAME
    path.write_text(json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n")
    return path


def read_metadata(ckpt_dir: str | Path) -> CheckpointMetadata:
    """Read and check ``megatron_darl.json``; errors name the file."""
    path = Path(ckpt_dir) / METADATA_NAME
    if not Path(ckpt_dir).is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: checkpoint directory does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (not a megatron_darl checkpoint directory)")
    try:
        data = json.loads(path.read_text())
        meta = CheckpointMetadata(**data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"{path}: corrupt metadata ({exc})") from None
    if meta.format != "megatron_darl" or meta.format_version > FORMAT_VERSION:
        raise ValueError(f"{path}: format {meta.format} v{meta.format_version} not supported")
    if not (Path(ckpt_dir) / "metadata.json").is_file():
        raise FileNotFoundError(f"{Path(ckpt_dir) / 'metadata.json'}: dist_checkpointing "
                                "metadata missing (incomplete checkpoint)")
    return meta


def _canonicalize(sharded: dict) -> dict:
    """Rename TE-fused norm keys to local names, in place, recursively."""
    for value in sharded.values():
        if isinstance(value, dict):
            _canonicalize(value)
            continue
        key = getattr(value, "key", None)
        if isinstance(key, str):
            for te, local in _TE_TO_LOCAL.items():
                if key.endswith(te):
                    value.key = key[: -len(te)] + local
    return sharded


def sharded_model_state_dict(model_chunks) -> dict:
    """The models' ``sharded_state_dict()`` with canonical (local-layer) checkpoint keys."""
    assert len(model_chunks) == 1, "virtual pipeline chunks are not supported yet"
    return _canonicalize(model_chunks[0].sharded_state_dict())


def save_model_checkpoint(model_chunks, ckpt_dir: str | Path, meta: CheckpointMetadata) -> None:
    """Collective over all ranks: write the model shards, then (rank 0) ``megatron_darl.json``.

    ``ckpt_dir`` must exist. The metadata file is written last, so its presence marks a
    complete checkpoint.
    """
    import megatron.core
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    sharded = sharded_model_state_dict(model_chunks)
    dist_checkpointing.save(sharded, str(ckpt_dir))
    dist.barrier()
    if dist.get_rank() == 0:
        meta.megatron_core_version = getattr(megatron.core, "__version__", "")
        write_metadata(ckpt_dir, meta)
    dist.barrier()


def load_model_checkpoint(model_chunks, ckpt_dir: str | Path) -> None:
    """Collective over all ranks: load model weights from a checkpoint (any saved TP/PP)."""
    from megatron.core import dist_checkpointing

    sharded = sharded_model_state_dict(model_chunks)
    kwargs = {}
    if "strict" in inspect.signature(dist_checkpointing.load).parameters:
        kwargs["strict"] = "assume_ok_unexpected"
    try:
        state = dist_checkpointing.load(sharded, str(ckpt_dir), **kwargs)
    except Exception as exc:  # noqa: BLE001 - torch.distributed.checkpoint raises many types
        msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{ckpt_dir}: cannot load checkpoint ({msg})") from exc
    missing, unexpected = model_chunks[0].load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{ckpt_dir}: checkpoint lacks {missing[:5]}")
