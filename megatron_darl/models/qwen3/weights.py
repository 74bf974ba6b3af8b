"""Copy HF weights into a built Megatron Qwen3 model, shard by shard.

Each rank computes only its own TP x PP shard (``iter_megatron_shard``) from tensors it reads
itself, so no rank holds the whole model and no weights travel between ranks. Every parameter
of the model must be written exactly once; anything left over is an error that names it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_darl.models.qwen3.hf_io import HFCheckpointReader
from megatron_darl.models.qwen3.mapping import TE_ALIASES, TensorGetter, iter_megatron_shard
from megatron_darl.models.qwen3.model import unwrap_qwen3


def _resolve(name: str, params: dict[str, torch.Tensor]) -> str:
    if name in params:
        return name
    for local, te in TE_ALIASES.items():
        if name.endswith(local) and name[: -len(local)] + te in params:
            return name[: -len(local)] + te
    raise KeyError(f"mapping produced {name}, which the model does not have")


@torch.no_grad()
def load_hf_weights(model_chunks, get: TensorGetter | dict, parallel_state, progress=None) -> int:
    """Copy HF tensors (a dict or a getter ``name -> tensor``) into this rank's model chunks.

    Returns the number of parameters written. Raises ``ValueError`` for a shape mismatch and
    ``RuntimeError`` if a model parameter was not covered by the mapping.
    """
    ps = parallel_state
    get = get.__getitem__ if isinstance(get, dict) else get
    written = 0
    for model in map(unwrap_qwen3, model_chunks):
        params = dict(model.named_parameters())
        todo = set(params)
        shard = iter_megatron_shard(
            get, model.qwen3_spec, ps.tp_rank, ps.tp_size, ps.pp_rank, ps.pp_size,
            model.padded_vocab,
        )
        for name, tensor in shard:
            target = params[_resolve(name, params)]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: HF shard shape {tuple(tensor.shape)} != "
                                 f"model shape {tuple(target.shape)}")
            target.copy_(tensor.to(dtype=target.dtype))
            todo.discard(_resolve(name, params))
            written += 1
            if progress is not None:
                progress.update(1)
        if todo:
            raise RuntimeError(f"parameters not loaded from HF: {sorted(todo)}")
    return written


def load_hf_checkpoint(model_chunks, hf_dir: str | Path, parallel_state, progress=None) -> int:
    """Stream a HF safetensors dir into the model: each rank reads only its own tensors.

    The checkpoint is validated (names and shapes) before anything is copied.
    """
    reader = HFCheckpointReader(hf_dir)
    reader.validate(unwrap_qwen3(model_chunks[0]).qwen3_spec)
    return load_hf_weights(model_chunks, reader.get, parallel_state, progress)
