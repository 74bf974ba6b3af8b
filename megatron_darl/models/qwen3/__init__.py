"""Qwen3 dense models on Megatron-core and their Hugging Face weight mapping.

Public API (importing this package imports neither torch nor Megatron; names load on first use,
PEP 562, so the launcher reads a model's shape without them):
- ``Qwen3Spec``, ``spec_from_hf``, ``transformer_config_from_hf``, ``padded_vocab_size``,
  ``check_layout``, ``load_preset``: architecture and Megatron config (``config.py``).
- ``build_qwen3_model``, ``qwen3_layer_spec``: the GPTModel per pipeline stage (``model.py``).
- ``hf_to_megatron_shard``, ``iter_megatron_shard``, ``megatron_to_hf_stage``,
  ``stage_hf_names``: the one HF<->Megatron mapping (``mapping.py``).
- ``load_hf_checkpoint``, ``load_hf_weights``: stream HF weights into a model (``weights.py``).
- ``forward_logits``, ``mask_padded_vocab_``, ``gather_vocab_logits``: logits (``logits.py``).
"""

from __future__ import annotations

from megatron_darl.lazy import lazy_exports

_HOMES = {
    "Qwen3Spec": "config", "check_layout": "config", "load_preset": "config", "padded_vocab_size": "config",
    "spec_from_hf": "config", "transformer_config_from_hf": "config",
    "causal_mask": "logits", "forward_logits": "logits", "gather_vocab_logits": "logits",
    "mask_padded_vocab_": "logits",
    "hf_to_megatron_shard": "mapping", "iter_megatron_shard": "mapping", "megatron_to_hf_stage": "mapping",
    "stage_hf_names": "mapping", "stage_layers": "mapping",
    "build_qwen3_model": "model", "qwen3_layer_spec": "model",
    "load_hf_checkpoint": "weights", "load_hf_weights": "weights",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOMES, globals())
