"""The entropy of the sampled distribution from vocab-parallel logits (``vocab_parallel_logprobs_entropy``):
values and gradients against plain ``torch`` on one rank; ``tests/distributed`` checks TP = 2."""

import torch

from megatron_darl.trainer.logprobs import vocab_parallel_logprobs, vocab_parallel_logprobs_entropy


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp_all = torch.log_softmax(logits / temperature, -1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def test_entropy_and_logprobs_match_torch_with_gradients():
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(13, 11, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (13,), generator=g)
    for temperature in (1.0, 0.6):
        logp, ent = vocab_parallel_logprobs_entropy(logits, targets, chunk_tokens=4, temperature=temperature)
        ref_logp, ref_ent = _reference(logits, targets, temperature)
        torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
        # a loss mixing both outputs: the gradient of each joins in one backward
        w_logp, w_ent = torch.randn(13, generator=g, dtype=torch.float64), torch.randn(13, generator=g,
                                                                                         dtype=torch.float64)
        (grad,) = torch.autograd.grad((w_logp * logp - w_ent * ent).sum(), logits)
        (ref_grad,) = torch.autograd.grad((w_logp * ref_logp - w_ent * ref_ent).sum(), logits)
        torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs_entropy(x, targets, chunk_tokens=5, temperature=0.8), (logits,))


def test_entropy_fp32_bounds_and_logprobs_equal_the_plain_pass():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 16, generator=g)
    targets = torch.randint(0, 16, (9,), generator=g)
    logp, ent = vocab_parallel_logprobs_entropy(logits, targets, chunk_tokens=4)
    assert torch.equal(logp, vocab_parallel_logprobs(logits, targets, chunk_tokens=4))  # the same arithmetic
    assert (ent > 0).all() and (ent <= torch.log(torch.tensor(16.0)) + 1e-6).all()
    uniform = vocab_parallel_logprobs_entropy(torch.zeros(2, 16), targets[:2])[1]
    torch.testing.assert_close(uniform, torch.full((2,), float(torch.log(torch.tensor(16.0)))))
    padded = logits.clone()
    padded[:, -3:] = torch.finfo(torch.float32).min  # padded vocab columns, then 1 / T = 2: -inf
    logp, ent = vocab_parallel_logprobs_entropy(padded.requires_grad_(), targets.clamp(max=12), temperature=0.5)
    ref_logp, ref_ent = _reference(logits[:, :-3].double(), targets.clamp(max=12), 0.5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    (ent.sum() + logp.sum()).backward()
    assert torch.isfinite(padded.grad).all() and (padded.grad[:, -3:] == 0).all()
