"""The fused Qwen3 layer on a GPU: compiled, bf16, at Qwen3-1.7B's layer shapes, against Megatron's
own layer forward over the same parameters (the CPU test checks the fp32 arithmetic exactly).

bf16 kernels round differently once fused, so both bf16 runs are measured against an fp32 run of
Megatron's forward over the same weights: the fused layer's output and every parameter's gradient
must be no further from it than Megatron's own bf16 layer is, within a quarter (relative error:
the norm of the difference over the fp32 norm). Then dynamo: compiled in the trainer's warm-up
order (the largest micro-batch of each pass first, then shorter rows, then one row), micro-batches
of other sizes, fewer tokens or longer rows, compile nothing new.
"""

from __future__ import annotations

import pytest
import torch


def _models(layers: int):
    """Megatron's 1.7B layers in bf16, and an fp32 copy of the same weights."""
    from megatron_darl.models.qwen3 import build_qwen3_model, load_preset
    from megatron_darl.trainer.parallel import init_single_process

    cfg = dict(load_preset("qwen3_1.7b"), num_hidden_layers=layers)
    ps = init_single_process()
    torch.manual_seed(0)
    [model] = build_qwen3_model(cfg, ps, dtype=torch.bfloat16, attention="sdpa")
    [exact] = build_qwen3_model(cfg, ps, dtype=torch.float32, attention="sdpa")
    weights = {k: v.float() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    exact.load_state_dict(weights, strict=False)
    return model, exact, cfg


def _run(model, ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    out = model(ids, pos, None)
    (out.float().square().mean()).backward()
    return out.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _forward(model, rows: int, seq: int, grad: bool) -> None:
    ids = torch.randint(0, model.padded_vocab // 2, (rows, seq), device="cuda")
    if grad:
        _run(model, ids)
        return
    with torch.no_grad():
        model(ids, torch.arange(seq, device="cuda").expand(rows, seq), None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.gpu
def test_fused_layer_matches_megatron_and_compiles_once():
    from megatron_darl.models.qwen3.fused_layer import fuse_layers
    from megatron_darl.trainer.policy_trainer import compiled_frames

    model, exact, cfg = _models(layers=2)
    ids = torch.randint(0, cfg["vocab_size"], (4, 320), device="cuda")
    fp32_out, fp32_grads = _run(exact, ids)
    bf16_out, bf16_grads = _run(model, ids)
    assert fuse_layers([model], tp_size=1) == (2, None)
    out, grads = _run(model, ids)
    assert _rel(out, fp32_out) <= 1.25 * _rel(bf16_out, fp32_out)
    for name, ref in fp32_grads.items():
        fused, megatron = _rel(grads[name], ref), _rel(bf16_grads[name], ref)
        print(f"{name}: fused {fused:.4g}, megatron {megatron:.4g}")
        assert fused <= 1.25 * megatron + 1e-4, (name, fused, megatron)

    # the trainer's warm-up order (PolicyTrainer.warm_up): the largest micro-batches first (16k
    # tokens with grad, 32k without), then shorter rows and one more (what dynamo's first-size
    # specialisations of the final norm and Megatron's fused kernels recompile at), then one row;
    # then any smaller micro-batch compiles nothing new
    torch._dynamo.reset()
    _forward(model, 32, 1024, grad=False)
    _forward(model, 16, 1024, grad=True)
    for grad in (False, True):
        _forward(model, 5, 768, grad=grad)
        _forward(model, 1, 1024, grad=grad)
    compiled = []  # (rows, seq, grad) of each call that compiled a frame
    for rows, seq in ((3, 192), (7, 448), (12, 1024), (2, 64), (1, 320), (1, 1984), (24, 1280)):
        for grad in (False, True):
            if grad and rows * seq > 16384:
                continue
            before = compiled_frames()
            _forward(model, rows, seq, grad=grad)
            if compiled_frames() > before:
                compiled.append((rows, seq, grad))
    assert compiled == []
