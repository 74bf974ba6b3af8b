"""The one Hugging Face <-> Megatron weight mapping for Qwen3 (converters, loading, weight sync).

Megatron layouts that differ from HF:
- ``linear_qkv`` fuses q/k/v **interleaved per query group**: for each KV group g the rows are
  [q heads of g, k_g, v_g]; TP splits whole groups, so the global layout is TP-independent.
- ``linear_fc1`` fuses SwiGLU as [gate; up] **per TP shard**: rank r holds
  [gate rows of r; up rows of r].
- Embedding / LM head rows are padded to ``padded_vocab`` (zeros) and split over TP.
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) split their input dim over TP;
  norms are replicated.
Names are Megatron's *local* layer names; with Transformer Engine layers the two input norms
live inside the fused linears (``TE_ALIASES``).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_darl.models.qwen3.config import padded_vocab_size, Qwen3Spec, spec_from_hf
from megatron_darl.models.qwen3.model import unwrap_qwen3

TensorGetter = Callable[[str], torch.Tensor]

HF_EMBED = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"
MG_EMBED = "embedding.word_embeddings.weight"
MG_FINAL_NORM = "decoder.final_layernorm.weight"
MG_LM_HEAD = "output_layer.weight"

# Megatron local suffix -> HF suffix, for tensors that map one to one.
_SIMPLE_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
# Megatron suffix -> (HF suffix, TP split dim) for row-parallel linears.
_ROW_PARALLEL = {
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}
MG_QKV = "self_attention.linear_qkv.weight"
MG_FC1 = "mlp.linear_fc1.weight"
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def stage_layers(spec: Qwen3Spec, pp_rank: int, pp_size: int) -> range:
    """Global layer indices held by pipeline stage ``pp_rank`` (even split)."""
    per = spec.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def hf_tensor_names(spec: Qwen3Spec, layers: range | None = None, ends: bool = True) -> list[str]:
    """HF names of ``layers`` (default all) plus embedding/norm/LM head when ``ends``."""
    names = [HF_EMBED] if ends else []
    for i in layers if layers is not None else range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + s for s in _SIMPLE_LAYER.values()]
        names += [p + s for s, _ in _ROW_PARALLEL.values()]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up")]
    if ends:
        names.append(HF_FINAL_NORM)
        if not spec.tie_word_embeddings:
            names.append(HF_LM_HEAD)
    return names


def stage_hf_names(spec: Qwen3Spec, pp_rank: int, pp_size: int) -> list[str]:
    """HF names that stage ``pp_rank`` yields in ``megatron_to_hf_stage``, in order."""
    names = hf_tensor_names(spec, stage_layers(spec, pp_rank, pp_size), ends=False)
    if pp_rank == 0:
        names.insert(0, HF_EMBED)
    if pp_rank == pp_size - 1:
        names.append(HF_FINAL_NORM)
        if not spec.tie_word_embeddings:
            names.append(HF_LM_HEAD)
    return names


def hf_tensor_shapes(spec: Qwen3Spec) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor name (to validate a checkpoint before loading)."""
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    by_suffix = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "self_attn.q_proj.weight": (spec.num_heads * hd, h),
        "self_attn.k_proj.weight": (spec.num_kv_heads * hd, h),
        "self_attn.v_proj.weight": (spec.num_kv_heads * hd, h),
        "self_attn.o_proj.weight": (h, spec.num_heads * hd),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    ends = {HF_EMBED: (spec.vocab_size, h), HF_FINAL_NORM: (h,), HF_LM_HEAD: (spec.vocab_size, h)}
    out = {}
    for name in hf_tensor_names(spec):
        out[name] = ends.get(name) or by_suffix[name.split(".", 3)[3]]
    return out


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Qwen3Spec) -> torch.Tensor:
    """HF q/k/v projections -> Megatron fused QKV rows, interleaved per query group."""
    g, hd = spec.num_kv_heads, spec.head_dim
    cols = q.shape[-1]
    q = q.reshape(g, spec.heads_per_group * hd, cols)
    k, v = k.reshape(g, hd, cols), v.reshape(g, hd, cols)
    return torch.cat([q, k, v], dim=1).reshape(-1, cols)


def unpack_qkv(qkv: torch.Tensor, spec: Qwen3Spec) -> tuple[torch.Tensor, ...]:
    """Inverse of ``pack_qkv`` for the full (TP-gathered) fused tensor."""
    g, hd, hpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    grouped = qkv.reshape(g, (hpg + 2) * hd, qkv.shape[-1])
    q, k, v = grouped.split([hpg * hd, hd, hd], dim=1)
    return tuple(t.reshape(-1, qkv.shape[-1]).contiguous() for t in (q, k, v))


def _pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    if weight.shape[0] == padded:
        return weight
    pad = weight.new_zeros(padded - weight.shape[0], weight.shape[1])
    return torch.cat([weight, pad], dim=0)


def _layer_shard(
    get: TensorGetter, spec: Qwen3Spec, hf_layer: int, tp_rank: int, tp_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    p = f"model.layers.{hf_layer}."
    for mg, hf in _SIMPLE_LAYER.items():
        yield mg, get(p + hf)
    for mg, (hf, dim) in _ROW_PARALLEL.items():
        yield mg, get(p + hf).chunk(tp_size, dim=dim)[tp_rank]
    qkv = pack_qkv(*(get(p + f"self_attn.{x}_proj.weight") for x in "qkv"), spec)
    yield MG_QKV, qkv.chunk(tp_size, dim=0)[tp_rank]  # whole groups per rank
    gate = get(p + "mlp.gate_proj.weight").chunk(tp_size, dim=0)[tp_rank]
    up = get(p + "mlp.up_proj.weight").chunk(tp_size, dim=0)[tp_rank]
    yield MG_FC1, torch.cat([gate, up], dim=0)


def iter_megatron_shard(
    get: TensorGetter,
    spec: Qwen3Spec,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    padded_vocab: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(megatron_local_name, shard)`` for one TP x PP shard, reading HF tensors lazily.

    ``get(hf_name)`` returns a full HF tensor; only the tensors of this stage are requested.
    With tied embeddings and PP > 1 the last stage also gets ``output_layer.weight`` (Megatron
    keeps a copy there) from ``model.embed_tokens.weight``.
    """
    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, tp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if first:
        yield MG_EMBED, _pad_vocab(get(HF_EMBED), vocab).chunk(tp_size, dim=0)[tp_rank]
    for local, hf_layer in enumerate(stage_layers(spec, pp_rank, pp_size)):
        for name, tensor in _layer_shard(get, spec, hf_layer, tp_rank, tp_size):
            yield f"decoder.layers.{local}.{name}", tensor
    if last:
        yield MG_FINAL_NORM, get(HF_FINAL_NORM)
        if not spec.tie_word_embeddings:
            yield MG_LM_HEAD, _pad_vocab(get(HF_LM_HEAD), vocab).chunk(tp_size, dim=0)[tp_rank]
        elif not first:
            yield MG_LM_HEAD, _pad_vocab(get(HF_EMBED), vocab).chunk(tp_size, dim=0)[tp_rank]


def hf_to_megatron_shard(
    hf: dict[str, torch.Tensor] | TensorGetter,
    hf_config,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    padded_vocab: int | None = None,
) -> dict[str, torch.Tensor]:
    """Megatron state dict (local layer names) of one TP x PP shard from HF tensors.

    Args:
        hf: a full HF state dict or a getter ``name -> tensor`` (e.g. lazy safetensors).
        hf_config: HF config / dict / ``Qwen3Spec``.
    """
    spec = hf_config if isinstance(hf_config, Qwen3Spec) else spec_from_hf(hf_config)
    get = hf.__getitem__ if isinstance(hf, dict) else hf
    return dict(iter_megatron_shard(get, spec, tp_rank, tp_size, pp_rank, pp_size, padded_vocab))


def _gather_tp(shard: torch.Tensor, group, tp_size: int) -> list[torch.Tensor]:
    if tp_size == 1:
        return [shard]
    parts = [torch.empty_like(shard) for _ in range(tp_size)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return parts


def _params(model) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters())
    for local, te in TE_ALIASES.items():  # report TE-fused norms under their local names
        for name in [n for n in named if n.endswith(te)]:
            named[name[: -len(te)] + local] = named.pop(name)
    return named


def megatron_to_hf_stage(model_chunks, parallel_state) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for everything this pipeline stage owns.

    Collective over the TP group: every TP rank of the stage must iterate it to the end, and
    every TP rank receives the same full tensors (the weight-sync leader is whichever rank
    sends). One parameter is gathered at a time. Tensors keep the model dtype and device;
    vocab padding is stripped; with tied embeddings ``lm_head.weight`` is not yielded (as in HF
    checkpoints). Replicated tensors (norms) are views of the live parameters: clone anything
    you keep past the next optimizer step.
    """
    ps = parallel_state
    for model in map(unwrap_qwen3, model_chunks):
        spec: Qwen3Spec = model.qwen3_spec
        params = _params(model)
        g = lambda name: _gather_tp(params[name].detach(), ps.tp_group, ps.tp_size)  # noqa: E731
        if MG_EMBED in params:
            yield HF_EMBED, torch.cat(g(MG_EMBED), dim=0)[: spec.vocab_size]
        for local, hf_layer in enumerate(stage_layers(spec, ps.pp_rank, ps.pp_size)):
            yield from _layer_to_hf(g, params, spec, f"decoder.layers.{local}.", hf_layer)
        if MG_FINAL_NORM in params:
            yield HF_FINAL_NORM, params[MG_FINAL_NORM].detach()
        if MG_LM_HEAD in params and not spec.tie_word_embeddings:
            yield HF_LM_HEAD, torch.cat(g(MG_LM_HEAD), dim=0)[: spec.vocab_size]


def _layer_to_hf(gather, params, spec: Qwen3Spec, mg: str, hf_layer: int):
    p = f"model.layers.{hf_layer}."
    for mg_name, hf_name in _SIMPLE_LAYER.items():  # replicated over TP: no gather
        yield p + hf_name, params[mg + mg_name].detach()
    for mg_name, (hf_name, dim) in _ROW_PARALLEL.items():
        yield p + hf_name, torch.cat(gather(mg + mg_name), dim=dim)
    q, k, v = unpack_qkv(torch.cat(gather(mg + MG_QKV), dim=0), spec)
    yield p + "self_attn.q_proj.weight", q
    yield p + "self_attn.k_proj.weight", k
    yield p + "self_attn.v_proj.weight", v
    halves = [shard.chunk(2, dim=0) for shard in gather(mg + MG_FC1)]
    yield p + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves], dim=0)
    yield p + "mlp.up_proj.weight", torch.cat([h[1] for h in halves], dim=0)
