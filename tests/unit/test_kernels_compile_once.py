"""The hand-fused kernels compile once per run: after their first calls, no micro-batch size,
grad mode or view layout makes dynamo compile again (inductor runs on CPU too, so the guards that
recompiled them on GPU show up here), and the compiled RMSNorm's forward and backward equal the
reference arithmetic under autograd."""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_darl.models.kernels import fused
from megatron_darl.models.qwen3.norm import fused_rms_norm, rms_norm_reference
from megatron_darl.trainer import logprobs


def _frames() -> int:
    return int(counters["frames"]["total"])


def _norm_case(rows: int, hidden: int, grad: bool, view: bool):
    gen = torch.Generator().manual_seed(rows + hidden)
    base = torch.randn(rows, 3 * hidden, generator=gen, dtype=torch.float64).float()
    x = base[:, hidden:2 * hidden] if view else base[:, :hidden].contiguous()
    weight = torch.randn(hidden, generator=gen, dtype=torch.float64).float()
    out = {}
    for name, fn in (("fused", fused_rms_norm), ("reference", rms_norm_reference)):
        xi = x.detach().clone().requires_grad_(grad)
        wi = weight.detach().clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = fn(xi.view(rows // 4, 4, hidden), wi, 1e-6)  # (rows/4, 4, hidden) as a model passes
            if grad:
                (y * torch.linspace(-1, 1, hidden)).sum().backward()
        out[name] = (y.detach(), xi.grad, wi.grad)
    return out


def test_rms_norm_compiles_once_and_matches_the_reference():
    calls = [(rows, hidden, grad, view) for rows in (512, 2048, 12, 3000, 4100)
             for hidden in (128, 64) for grad in (False, True) for view in (False, True)]
    after_first = None
    for i, case in enumerate(calls):
        out = _norm_case(*case)
        ref, got = out["reference"], out["fused"]
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
        if case[2]:
            torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got[2], ref[2], rtol=1e-4, atol=1e-4)
        if i == 7:  # both hidden sizes, both grad modes, both layouts seen once
            after_first = _frames()
    assert _frames() == after_first, "RMSNorm recompiled for a new row count or layout"


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_log_prob_kernels_compile_once_for_any_chunk(scale):
    row_max = fused(logprobs._row_max, rows=(0,))
    sum_exp = fused(logprobs._row_sum_exp, rows=(0, 1))
    chunk_grad = fused(logprobs._chunk_grad, rows=(0, 1, 2, 3, 4))
    vocab = 300
    after_first = None
    for i, (n, grad) in enumerate([(700, False), (700, True), (1500, True), (3, False),
                                   (2100, False), (999, True)]):
        logits = torch.randn(n + 5, vocab, requires_grad=grad)
        x = logits[:n]  # a chunk is a view of the logits, partial or whole
        targets = torch.randint(0, vocab, (n,))
        m = row_max(x, torch.float32, scale)
        lse = m + torch.log(sum_exp(x, m, scale))
        g = torch.ones(()).expand(n)  # a sum's gradient: stride 0
        got = chunk_grad(x, lse, g.contiguous(), targets, torch.ones(n, dtype=torch.bool), scale)
        probs = torch.softmax(x.detach() * scale, -1)
        torch.testing.assert_close(lse, torch.logsumexp(x.detach() * scale, -1))
        want = (torch.nn.functional.one_hot(targets, vocab).float() - probs) * scale
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if i == 1:
            after_first = _frames()
    assert _frames() == after_first, "a log-prob kernel recompiled for a new chunk"
