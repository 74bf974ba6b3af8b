"""Qwen3 as a Megatron ``GPTModel``: the layer ``ModuleSpec`` and the per-stage builder.

The spec is Megatron's GPT layer with qk-norm (RMSNorm per head), SwiGLU and no biases. The
backend is chosen once: Transformer Engine layers when ``transformer_engine`` imports, otherwise
Megatron's local layers with ``SDPACoreAttention`` (PyTorch SDPA) as core attention. ``local``
(Megatron's unfused ``DotProductAttention``) is kept as a benchmark baseline; it needs explicit
causal masks (``needs_attention_mask``).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from megatron_darl.models.qwen3.config import (
    Qwen3Spec,
    padded_vocab_size,
    spec_from_hf,
    transformer_config_from_hf,
)
from megatron_darl.models.qwen3.norm import Qwen3RMSNorm

ATTENTION_BACKENDS = ("auto", "te", "sdpa", "local")


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def resolve_backend(attention: str) -> str:
    """``auto`` -> ``te`` when Transformer Engine imports, else ``sdpa``."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {attention!r}; choose one of {ATTENTION_BACKENDS}")
    if attention == "auto":
        return "te" if have_transformer_engine() else "sdpa"
    if attention == "te" and not have_transformer_engine():
        raise ValueError("attention backend 'te' requested but transformer_engine does not import")
    return attention


def qwen3_layer_spec(backend: str):
    """``ModuleSpec`` of one Qwen3 decoder layer for ``backend`` in ``te|sdpa|local``."""
    from megatron.core.models.gpt import gpt_layer_specs

    if backend == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    if backend == "sdpa":
        # defers Megatron (seconds to import): attention.py subclasses its core attention
        from megatron_darl.models.qwen3.attention import SDPACoreAttention

        spec = copy.deepcopy(spec)
        attn = spec.submodules.self_attention.submodules
        attn.core_attention = SDPACoreAttention
        attn.q_layernorm = attn.k_layernorm = Qwen3RMSNorm
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = Qwen3RMSNorm
    return spec


def qwen3_block_spec(layer_spec, num_local_layers: int):
    """The decoder block: ``num_local_layers`` copies of the layer plus the final RMSNorm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    fused_norm = layer_spec.submodules.input_layernorm
    if fused_norm is None or getattr(fused_norm, "__name__", "") == "IdentityOp":
        # TE fuses the input norm into linear_qkv; the final norm is TE's RMSNorm.
        from megatron.core.extensions.transformer_engine import TENorm as norm
    elif getattr(fused_norm, "__name__", "") == "Qwen3RMSNorm":
        norm = Qwen3RMSNorm
    else:
        # torch.nn.RMSNorm behind Megatron's wrapper (stable across megatron-core versions).
        from megatron.core.transformer.torch_norm import WrappedTorchNorm as norm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_local_layers, layer_norm=norm)


def unwrap_qwen3(model):
    """The ``GPTModel`` inside Megatron DDP / Float16Module wrappers (they nest ``.module``)."""
    while not hasattr(model, "qwen3_spec") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "qwen3_spec"):
        raise TypeError(f"{type(model).__name__} was not built by build_qwen3_model")
    return model


def _supported_kwargs(fn, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def build_qwen3_model(
    hf_config: Any,
    parallel_state,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    attention: str = "auto",
    padded_vocab: int | None = None,
    **config_overrides: Any,
) -> list:
    """Build this rank's Qwen3 model chunks (one ``GPTModel``; a list for future VPP).

    Args:
        hf_config: ``transformers`` config, its dict, or a ``Qwen3Spec``.
        parallel_state: ``ParallelState`` from ``megatron_darl.trainer.parallel.init_parallel``.
        pre_process / post_process: default to first / last pipeline stage.
        dtype: parameter dtype (fp32 on CPU, bf16 on GPU).
        attention: ``auto|te|sdpa|local`` (see module docstring).
        padded_vocab: embedding rows; default ``padded_vocab_size(vocab, tp)``. Pass the
            value recorded in a checkpoint to reload it.
        config_overrides: extra ``TransformerConfig`` fields (recompute, init...).

    Returns:
        ``[GPTModel]`` on ``parallel_state.device`` with random init (load weights next).
    """
    from megatron.core.models.gpt import GPTModel

    spec = hf_config if isinstance(hf_config, Qwen3Spec) else spec_from_hf(hf_config)
    ps = parallel_state
    backend = resolve_backend(attention)
    config = transformer_config_from_hf(
        spec, tp=ps.tp_size, pp=ps.pp_size, dtype=dtype, on_cpu=ps.on_cpu, **config_overrides
    )
    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, ps.tp_size)
    if vocab < spec.vocab_size or vocab % ps.tp_size:
        raise ValueError(f"padded_vocab={vocab} must be >= {spec.vocab_size} and divisible by tp")
    layer_spec = qwen3_layer_spec(backend)
    kwargs = dict(
        config=config,
        transformer_layer_spec=qwen3_block_spec(layer_spec, spec.num_layers // ps.pp_size),
        vocab_size=vocab,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_first_stage if pre_process is None else pre_process,
        post_process=ps.is_last_stage if post_process is None else post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,
        pg_collection=ps.pg_collection,
    )
    model = GPTModel(**_supported_kwargs(GPTModel.__init__, kwargs))
    model.to(ps.device)
    for param in model.parameters():  # torch.nn.RMSNorm ignores params_dtype: norms came fp32
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    model.qwen3_spec = spec  # read by the mapping and the logits helpers
    model.padded_vocab = vocab
    model.needs_attention_mask = backend == "local"
    return [model]
