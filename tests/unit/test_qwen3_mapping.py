"""Qwen3 spec parsing, vocab padding, size presets and HF<->Megatron tensor layouts (no ranks)."""

from __future__ import annotations

import pytest
import torch

from megatron_darl.models.qwen3 import (
    Qwen3Spec,
    check_layout,
    hf_to_megatron_shard,
    load_preset,
    padded_vocab_size,
    spec_from_hf,
    stage_hf_names,
)
from megatron_darl.models.qwen3.mapping import hf_tensor_shapes, pack_qkv, unpack_qkv

TINY = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=300, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=128,
)


def _random_hf(spec: Qwen3Spec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in hf_tensor_shapes(spec).items()}


def test_spec_reads_new_and_old_rope_fields():
    new = spec_from_hf(TINY)
    old = dict(TINY, rope_theta=5e5)
    old.pop("rope_parameters")
    assert new.rope_theta == 1e6 and spec_from_hf(old).rope_theta == 5e5
    assert new.head_dim == 16 and new.heads_per_group == 2 and not new.tie_word_embeddings


def test_spec_rejects_other_architectures_by_name():
    llama = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM is not supported; supported: Qwen3"):
        spec_from_hf(llama, "x/config.json")
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        spec_from_hf(dict(TINY, rope_parameters={"rope_theta": 1e6, "rope_type": "yarn"}))


@pytest.mark.parametrize("tp,pp,msg", [
    (3, 1, "tp=3 does not divide num_attention_heads=4"),
    (4, 1, "tp=4 does not divide num_key_value_heads"),
    (1, 8, "pp=8 is larger than num_hidden_layers=4"),
    (1, 3, "pp=3 does not divide num_hidden_layers=4"),
])
def test_layout_errors_name_the_value(tp, pp, msg):
    with pytest.raises(ValueError, match=msg):
        check_layout(spec_from_hf(TINY), tp, pp)


def test_padded_vocab_is_tp_independent_for_powers_of_two():
    assert [padded_vocab_size(300, tp) for tp in (1, 2, 4, 8)] == [384] * 4
    assert padded_vocab_size(151936, 8) == 151936  # real Qwen3 vocab needs no padding
    assert padded_vocab_size(300, 3) % 3 == 0 and padded_vocab_size(300, 3) >= 300


def test_qkv_is_interleaved_per_query_group():
    spec = spec_from_hf(TINY)  # 4 heads, 2 groups, head_dim 16
    rows = lambda n: torch.arange(n * 16, dtype=torch.float32)[:, None]  # noqa: E731
    q, k, v = rows(4), rows(2) + 1000, rows(2) + 2000
    qkv = pack_qkv(q, k, v, spec)[:, 0]
    group0 = torch.cat([q[:32, 0], k[:16, 0], v[:16, 0]])
    assert torch.equal(qkv[:64], group0)  # [q heads 0,1 ; k0 ; v0] then group 1
    assert all(torch.equal(a, b) for a, b in zip(unpack_qkv(pack_qkv(q, k, v, spec), spec),
                                                 (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2])
def test_shards_reassemble_to_the_full_tensors(tp):
    spec = spec_from_hf(TINY)
    hf = _random_hf(spec)
    shards = [hf_to_megatron_shard(hf, TINY, r, tp, 0, 1) for r in range(tp)]
    fc1 = [s["decoder.layers.1.mlp.linear_fc1.weight"] for s in shards]
    gate = torch.cat([f.chunk(2)[0] for f in fc1])
    assert torch.equal(gate, hf["model.layers.1.mlp.gate_proj.weight"])
    qkv = torch.cat([s["decoder.layers.3.self_attention.linear_qkv.weight"] for s in shards])
    q, k, v = unpack_qkv(qkv, spec)
    assert torch.equal(k, hf["model.layers.3.self_attn.k_proj.weight"])
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert emb.shape == (384, 64) and torch.equal(emb[:300], hf["model.embed_tokens.weight"])
    assert emb[300:].abs().sum() == 0  # padding rows are zeros
    o = torch.cat([s["decoder.layers.0.self_attention.linear_proj.weight"] for s in shards], 1)
    assert torch.equal(o, hf["model.layers.0.self_attn.o_proj.weight"])


def test_pipeline_stages_get_local_layer_names_and_ends():
    tied = dict(TINY, tie_word_embeddings=True)
    spec = spec_from_hf(tied)
    hf = _random_hf(spec)
    first = hf_to_megatron_shard(hf, tied, 0, 1, 0, 2)
    last = hf_to_megatron_shard(hf, tied, 0, 1, 1, 2)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"],
                       hf["model.layers.2.input_layernorm.weight"])
    # tied + PP: the last stage keeps Megatron's copy of the embedding as output_layer
    assert torch.equal(last["output_layer.weight"][:300], hf["model.embed_tokens.weight"])
    assert stage_hf_names(spec, 1, 2)[-1] == "model.norm.weight"
    assert len(stage_hf_names(spec, 0, 2)) + len(stage_hf_names(spec, 1, 2)) == len(hf)


@pytest.mark.parametrize("name,non_embedding_b,tie", [
    ("qwen3_0.6b", 0.44, True), ("qwen3_1.7b", 1.4, True), ("qwen3_4b", 3.6, True),
    ("qwen3_8b", 6.95, False), ("qwen3_14b", 13.2, False), ("qwen3_32b", 31.2, False),
])
def test_size_presets_match_the_model_cards(name, non_embedding_b, tie):
    spec = spec_from_hf(load_preset(name), name)
    shapes = hf_tensor_shapes(spec)
    non_emb = sum(torch.Size(s).numel() for n, s in shapes.items()
                  if n not in ("model.embed_tokens.weight", "lm_head.weight"))
    assert non_emb / 1e9 == pytest.approx(non_embedding_b, rel=0.015)  # cards round
    assert spec.tie_word_embeddings is tie and spec.head_dim == 128 and spec.vocab_size == 151936
    with pytest.raises(ValueError, match="no model preset"):
        load_preset("qwen3_1b")
