"""Weight sources for weight-sync tests: HF-named full tensors per trainer PP stage.

Swappable on purpose: the trainer procs take ``--source module:function`` with the signature
``fn(model_dir, version, stage, num_stages) -> list[(hf_name, tensor)]``. Today the source is a
TP/PP-free Hugging Face model whose ``state_dict`` is split into stages by layer; once the
Megatron trainer export exists, a TP2xPP2 source plugs in here unchanged.
"""

from __future__ import annotations

import importlib
import re
from functools import lru_cache
from typing import Callable

import torch
import transformers

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters={"rope_theta": 1e6}, tie_word_embeddings=True)


def tiny_config() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(**TINY)


def save_tiny_model(path: str, seed: int = 0) -> None:
    """Randomly initialised tiny Qwen3 saved as an HF checkpoint (version 0 for everyone)."""
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(path)


@lru_cache(maxsize=4)
def _state(model_dir: str, version: int) -> dict[str, torch.Tensor]:
    if version == 0:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        torch.manual_seed(1000 + version)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stage_of(name: str, num_layers: int, num_stages: int) -> int:
    """PP stage owning an HF tensor name: layers split evenly, embeddings first, head last."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) * num_stages // num_layers
    return 0 if name.startswith("model.embed_tokens") else num_stages - 1


def hf_stages(model_dir: str, version: int, stage: int, num_stages: int) -> list[tuple[str, torch.Tensor]]:
    """The HF model of ``version`` split into ``num_stages`` stages; this stage's tensors."""
    state = _state(model_dir, version)
    layers = tiny_config().num_hidden_layers
    return [(k, v) for k, v in state.items() if stage_of(k, layers, num_stages) == stage]


def load_source(spec: str) -> Callable[[str, int, int, int], list[tuple[str, torch.Tensor]]]:
    """``module:function`` -> the function."""
    module, _, fn = spec.partition(":")
    return getattr(importlib.import_module(module), fn)
