"""The "another pipeline" example of docs/algorithm.md runs and gives a finite, trainable loss."""

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithm.md"


def test_doc_example_runs():
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None, "docs/algorithm.md lost its python example"
    namespace: dict = {}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)
    g = torch.Generator().manual_seed(0)
    n, t = 8, 5
    logp_by_version = -torch.rand(3, n, t, generator=g)  # (K, N, T)
    old_logp = -torch.rand(n, t, generator=g)
    logp = (old_logp + 0.01 * torch.randn(n, t, generator=g)).requires_grad_()
    mask = torch.ones(n, t, dtype=torch.bool)
    loss, stats = namespace["darl_loss"](
        logp, old_logp, logp_by_version, torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7, 7] * 2),
        torch.tensor([0.0, 1.0] * 4), torch.arange(n) // 4, mask,
    )
    loss.backward()
    assert torch.isfinite(loss) and logp.grad.abs().sum() > 0
    assert 0 < stats["weight_ess"] <= 1 and stats["num_tokens"] == n * t
