"""The log-prob kernels compile once per run: after their first calls, no chunk size, grad mode or
view layout makes dynamo compile again (inductor runs on CPU too, so the guards that recompiled
them on GPU show up here), and they compute what the eager arithmetic does."""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_darl.trainer.kernels import fused
from megatron_darl.trainer import logprobs


def _frames() -> int:
    return int(counters["frames"]["total"])


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
