"""The fused Qwen3 layer (``models/qwen3/fused_layer.py``) is Megatron's layer arithmetic.

On CPU, fp32, a tiny model with grouped-query attention: the fused forward gives Megatron's
logits and every parameter's gradient to 1e-6 relative (the only difference is SDPA over keys
repeated per head instead of SDPA's own grouping). A call that passes an attention mask goes to
Megatron's forward, and layouts the fused arithmetic does not cover are refused with the reason.
The GPU test (tests/gpu/test_fused_layer_gpu.py) runs the compiled kernel at 1.7B shapes.
"""

from __future__ import annotations

import pytest
import torch

TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_parameters={"rope_theta": 1e6},
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def ps():
    from megatron_darl.trainer.parallel import destroy_parallel, init_single_process

    state = init_single_process()
    yield state
    destroy_parallel()


def _model(ps, attention: str = "sdpa"):
    from megatron_darl.models.qwen3.model import build_qwen3_model

    torch.manual_seed(0)
    [model] = build_qwen3_model(TINY, ps, attention=attention)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so a swapped norm weight shows
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def _step(model, ids: torch.Tensor, mask: torch.Tensor | None = None):
    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = model(ids, pos, mask)
    (out.float().square().mean()).backward()
    return out.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_fused_layer_gives_megatrons_logits_and_gradients(ps, monkeypatch):
    from megatron_darl.models.qwen3 import fused_layer

    model = _model(ps)
    ids = torch.randint(0, TINY["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = _step(model, ids)
    assert fused_layer.fuse_layers([model], tp_size=1) == (2, None)
    assert fused_layer.fuse_layers([model], tp_size=1) == (2, None)  # again: nothing wrapped twice
    calls = []
    real = fused_layer.qwen3_layer
    monkeypatch.setattr(fused_layer, "qwen3_layer", lambda *a: calls.append(1) or real(*a))
    out, grads = _step(model, ids)
    assert len(calls) == 2  # one call a layer
    assert _rel(out, ref_out) < 1e-6
    assert grads.keys() == ref_grads.keys() and len(grads) == 1 + 2 * 8 + 1
    for name, ref in ref_grads.items():
        assert _rel(grads[name], ref) < 1e-6, name
        assert ref.abs().max() > 0, name  # every parameter got a gradient to compare


def test_a_call_with_a_mask_runs_megatrons_forward(ps, monkeypatch):
    from megatron_darl.models.qwen3 import fused_layer

    model = _model(ps)
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    causal = torch.triu(torch.ones(24, 24, dtype=torch.bool), diagonal=1)[None, None]
    ref_out, _ = _step(model, ids, causal)
    fused_layer.fuse_layers([model], tp_size=1)
    monkeypatch.setattr(fused_layer, "qwen3_layer", lambda *a: pytest.fail("fused with a mask"))
    out, _ = _step(model, ids, causal)
    assert torch.equal(out, ref_out)


def test_layouts_it_does_not_cover_and_eager_kernels_keep_megatrons_forward(ps):
    from megatron_darl.models.qwen3.fused_layer import FusedLayer, fuse_layers

    model = _model(ps)
    assert fuse_layers([model], tp_size=2) == (0, "tensor parallel 2")
    assert fuse_layers([model], tp_size=1, compiled=False) == (0, "trainer.compiled_kernels=false")
    local = _model(ps, attention="local")
    count, why = fuse_layers([local], tp_size=1)
    assert count == 0 and "DotProductAttention" in why
    layers = list(model.decoder.layers) + list(local.decoder.layers)
    assert not any(isinstance(layer.forward, FusedLayer) for layer in layers)


def test_fused_layers_is_on_by_default_and_in_the_default_config():
    from pathlib import Path

    import yaml

    from megatron_darl.trainer.config import TrainerConfig

    repo = Path(__file__).resolve().parents[2]
    defaults = yaml.safe_load((repo / "configs" / "trainer" / "default.yaml").read_text())
    assert defaults["fused_layers"] is True and TrainerConfig().fused_layers is True
