"""Qwen3 dense models on Megatron-core and their Hugging Face weight mapping.

Public API (importing this package does not import Megatron; building a model does):
- ``Qwen3Spec``, ``spec_from_hf``, ``transformer_config_from_hf``, ``padded_vocab_size``,
  ``check_layout``, ``load_preset``: architecture and Megatron config (``config.py``).
- ``build_qwen3_model``, ``qwen3_layer_spec``: the GPTModel per pipeline stage (``model.py``).
- ``hf_to_megatron_shard``, ``iter_megatron_shard``, ``megatron_to_hf_stage``,
  ``stage_hf_names``: the one HF<->Megatron mapping (``mapping.py``).
- ``load_hf_checkpoint``, ``load_hf_weights``: stream HF weights into a model (``weights.py``).
- ``forward_logits``, ``mask_padded_vocab_``, ``gather_vocab_logits``: logits (``logits.py``).
"""

from megatron_darl.models.qwen3.config import (
    Qwen3Spec,
    check_layout,
    load_preset,
    padded_vocab_size,
    spec_from_hf,
    transformer_config_from_hf,
)
from megatron_darl.models.qwen3.logits import (
    causal_mask,
    forward_logits,
    gather_vocab_logits,
    mask_padded_vocab_,
)
from megatron_darl.models.qwen3.mapping import (
    hf_to_megatron_shard,
    iter_megatron_shard,
    megatron_to_hf_stage,
    stage_hf_names,
    stage_layers,
)
from megatron_darl.models.qwen3.model import build_qwen3_model, qwen3_layer_spec
from megatron_darl.models.qwen3.weights import load_hf_checkpoint, load_hf_weights

__all__ = [
    "Qwen3Spec", "build_qwen3_model", "causal_mask", "check_layout", "forward_logits",
    "gather_vocab_logits", "hf_to_megatron_shard", "iter_megatron_shard", "load_hf_checkpoint",
    "load_hf_weights", "load_preset", "mask_padded_vocab_", "megatron_to_hf_stage",
    "padded_vocab_size", "qwen3_layer_spec", "spec_from_hf", "stage_hf_names", "stage_layers",
    "transformer_config_from_hf",
]
