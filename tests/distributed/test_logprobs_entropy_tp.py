"""Entropy and log-probs of vocab-parallel logits at TP = 2 (gloo) equal the one-rank values.

Each of two processes holds half of the vocabulary columns (Megatron's layout); the per-row entropy
needs the all-reduced max and sums of both halves, and each rank's logit gradient is its half of
the full one. Compared with plain ``torch`` on the whole logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_darl.trainer.logprobs import vocab_parallel_logprobs_entropy

N, V, T = 7, 12, 0.7


def _inputs():
    g = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(N, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (N,), generator=g)
    w_logp, w_ent = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    return logits, targets, w_logp, w_ent


def _rank(rank: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        logits, targets, w_logp, w_ent = _inputs()
        mine = logits[:, rank * V // 2:(rank + 1) * V // 2].clone().requires_grad_()
        logp, ent = vocab_parallel_logprobs_entropy(mine, targets, dist.group.WORLD, chunk_tokens=3, temperature=T)
        (w_logp * logp + w_ent * ent).sum().backward()
        out[rank] = (logp.detach(), ent.detach(), mine.grad)
    finally:
        dist.destroy_process_group()


def test_tp2_entropy_logprobs_and_grads_equal_one_rank(tmp_path):
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(f"file://{tmp_path}/init", out), nprocs=2, join=True)
    logits, targets, w_logp, w_ent = _inputs()
    logits.requires_grad_()
    logp_all = torch.log_softmax(logits / T, -1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ref_logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    (w_logp * ref_logp + w_ent * ref_ent).sum().backward()
    for rank in (0, 1):
        logp, ent, grad = out[rank]
        torch.testing.assert_close(logp, ref_logp.detach(), atol=1e-12, rtol=0)
        torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-12, rtol=0)
        torch.testing.assert_close(grad, logits.grad[:, rank * V // 2:(rank + 1) * V // 2], atol=1e-12, rtol=0)
