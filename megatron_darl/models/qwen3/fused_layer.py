"""One Qwen3 decoder layer as one function of its own parameters, compiled once for every layer.

Without Transformer Engine a Megatron layer is ~50 host calls: four compiled norms, Megatron's
compiled SwiGLU and bias-dropout-add, four linear layers that are each an autograd Function, the
rotary arithmetic and SDPA. At the micro-batches of an RL step (a few thousand tokens on a DP rank
of a 1.7B model) the host cannot issue them as fast as the device runs them: a DP2 rank's step took
as long as a single GPU's with half its matmul time (docs/status.md, the quick batch's train step).
Here the layer is one ``torch.compile`` region (the forward one call, its backward one call):
inductor fuses the norms, rotary, residual adds and SwiGLU around the four matmuls and SDPA.

The function reads the layer's parameters (``linear_qkv.weight``...) at each call, so everything
else stays Megatron's: the ``GPTModel`` and its checkpoint keys, DDP's gradient hooks (they sit
on the parameters' gradient accumulators, which the compiled backward still feeds), the
distributed optimizer, pipeline schedules and activation recompute (which calls the layer, so
runs this function under ``torch.no_grad`` and again with grad). The arithmetic is Megatron's
local layer, op for op: qkv interleaved per query group, qk-norm before rotary
(``rotate_half``, cos/sin in the activation dtype), causal SDPA, bias-free residual adds, SwiGLU
as ``silu(first half) * second half``.

A layer is fused only where that arithmetic is the whole layer: one tensor-parallel rank (no
collective inside), the SDPA backend, no bias, no dropout, no attention mask or packed sequences
(the layer falls back to Megatron's forward for a call that passes one). Everything else keeps
Megatron's forward. The compiled function is shared: all layers have the same shapes, so it
compiles once per grad mode and once for a one-row micro-batch (dynamo specialises size 1), with
no range guard on the token count (``norm.compile_dynamic``); the trainer's warm-up reaches these
variants before the first step, at a full micro-batch first (``PolicyTrainer._full_budget``: the
sizes the first compile sees steer inductor's tuning). On CPU it runs eagerly (tests).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_darl.models.qwen3.norm import compile_dynamic, Qwen3RMSNorm, rms_norm_reference


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return t * cos + _rotate_half(t) * sin


def qwen3_layer(x: torch.Tensor, freqs: torch.Tensor, weights: tuple[torch.Tensor, ...],
                heads: int, groups: int, dim: int, eps: float, scale: float) -> torch.Tensor:
    """One decoder layer: ``x`` ``[s, b, hidden]``, ``freqs`` Megatron's rotary angles
    ``[s, 1, 1, dim]`` (fp32); ``weights`` = input norm, qkv, q-norm, k-norm, proj, pre-MLP norm,
    fc1, fc2 (``FusedLayer.WEIGHTS``). Returns the layer's output ``[s, b, hidden]``."""
    ln1, qkv, q_norm, k_norm, proj, ln2, fc1, fc2 = weights
    s, b = x.shape[0], x.shape[1]
    per_group = heads // groups
    mixed = F.linear(rms_norm_reference(x, ln1, eps), qkv).view(s, b, groups, (per_group + 2) * dim)
    q, k, v = torch.split(mixed, [per_group * dim, dim, dim], dim=3)
    q = rms_norm_reference(q.reshape(s, b, heads, dim), q_norm, eps)
    k = rms_norm_reference(k, k_norm, eps)
    cos, sin = torch.cos(freqs).to(x.dtype), torch.sin(freqs).to(x.dtype)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    # [b, heads, s, dim]; k and v repeated per query head: torch 2.11's dynamo breaks the graph
    # at SDPA's enable_gqa
    q = q.permute(1, 2, 0, 3)
    k = k.permute(1, 2, 0, 3).repeat_interleave(per_group, dim=1)
    v = v.permute(1, 2, 0, 3).repeat_interleave(per_group, dim=1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    x = x + F.linear(attn.permute(2, 0, 1, 3).reshape(s, b, heads * dim), proj)
    gate, up = torch.chunk(F.linear(rms_norm_reference(x, ln2, eps), fc1), 2, dim=-1)
    return x + F.linear(F.silu(gate) * up, fc2)


_compiled_layer = None


def _compiled(x: torch.Tensor):
    global _compiled_layer
    if not x.is_cuda:
        return qwen3_layer
    if _compiled_layer is None:
        _compiled_layer = compile_dynamic(qwen3_layer)
    return _compiled_layer


class FusedLayer:
    """The forward of one Megatron ``TransformerLayer`` replaced by ``qwen3_layer`` (``fuse``)."""

    WEIGHTS = ("input_layernorm.weight", "self_attention.linear_qkv.weight",
               "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
               "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")

    def __init__(self, layer) -> None:
        self.megatron_forward = layer.forward
        attn = layer.self_attention
        self.heads = attn.num_attention_heads_per_partition
        self.groups = attn.num_query_groups_per_partition
        self.dim = attn.hidden_size_per_attention_head
        self.eps = float(layer.input_layernorm.eps)
        self.scale = float(attn.core_attention.softmax_scale)
        params = dict(layer.named_parameters())
        self.params = [params[name] for name in self.WEIGHTS]

    def __call__(self, hidden_states: torch.Tensor, attention_mask=None, context=None, context_mask=None,
                 rotary_pos_emb=None, packed_seq_params=None, inference_context=None, **kwargs: Any):
        unsupported = (attention_mask, context, packed_seq_params, inference_context,
                       kwargs.get("attention_bias"), kwargs.get("inference_params"))
        if rotary_pos_emb is None or any(arg is not None for arg in unsupported):
            return self.megatron_forward(hidden_states, attention_mask=attention_mask, context=context,
                                         context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
                                         packed_seq_params=packed_seq_params,
                                         inference_context=inference_context, **kwargs)
        fn = _compiled(hidden_states)
        # contiguous: the first layer's input is the embedding's transpose, and dynamo guards on strides
        # (one row keeps the transpose's stride on its size-1 dimension: one more graph, in the warm-up)
        out = fn(hidden_states.contiguous(), rotary_pos_emb, tuple(self.params), self.heads, self.groups,
                 self.dim, self.eps, self.scale)
        return out, context


def fusable(layer, tp_size: int) -> str | None:
    """Why ``layer`` cannot be fused (``None``: it can)."""
    config = layer.config
    if tp_size != 1:
        return f"tensor parallel {tp_size}"
    if type(layer.self_attention.core_attention).__name__ != "SDPACoreAttention":
        return f"core attention {type(layer.self_attention.core_attention).__name__}"
    if config.add_bias_linear or config.add_qkv_bias:
        return "biases"
    if config.hidden_dropout or config.attention_dropout:
        return "dropout"
    if config.fp32_residual_connection or config.context_parallel_size != 1:
        return "fp32 residual or context parallel"
    if not isinstance(layer.input_layernorm, Qwen3RMSNorm):
        return f"norm {type(layer.input_layernorm).__name__}"
    names = sorted(name for name, _ in layer.named_parameters())
    if names != sorted(FusedLayer.WEIGHTS):
        return f"parameters {names}"
    return None


def fuse_layers(chunks: list, tp_size: int, compiled: bool = True) -> tuple[int, str | None]:
    """Replace each decoder layer's forward in ``chunks`` by a ``FusedLayer``; returns how many
    were fused and, when none was, why. ``compiled`` (the trainer's ``compiled_kernels``): off, no
    layer is fused, so that switch still runs every kernel eagerly on GPU."""
    if not compiled:
        return 0, "trainer.compiled_kernels=false"
    layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
    reasons = {fusable(layer, tp_size) for layer in layers}
    if not layers or reasons != {None}:
        return 0, "; ".join(sorted(r for r in reasons if r)) or "no decoder layers"
    for layer in layers:
        if not isinstance(layer.forward, FusedLayer):
            layer.forward = FusedLayer(layer)
    return len(layers), None
