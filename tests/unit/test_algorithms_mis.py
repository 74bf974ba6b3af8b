"""Multiple importance sampling by Monte Carlo, and the reductions of docs/algorithm.md, section 4.

- The balance-heuristic estimate built with ``mixture_log_density`` from samples of three
  behavior versions is unbiased for an expectation under the target policy.
- With one version it is ordinary importance sampling; one version in a batch makes ``darl``
  identical to ``decoupled``; with target = behavior and ratio 1 the gradient of ``policy_loss``
  is the GRPO policy gradient.
"""

import torch

from megatron_darl.algorithms import (
    batch_behavior_weights,
    behavior_weights,
    grpo_advantages,
    mixture_log_density,
    policy_loss,
    version_alpha,
)

VOCAB = 6


def _toy_policies():
    """Target and three behavior categoricals over a 6-token vocabulary, and f(y)."""
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(4, VOCAB, generator=g, dtype=torch.float64)
    logits[1:] += 0.8 * torch.randn(3, VOCAB, generator=g, dtype=torch.float64)  # drift
    logp = torch.log_softmax(logits, dim=-1)  # (4, V): target, then versions 1..3
    f = torch.linspace(-1.0, 2.0, VOCAB, dtype=torch.float64) ** 2  # (V,)
    return logp[0], logp[1:], f


def test_mixture_importance_sampling_matches_exact_expectation():
    logp_target, logp_versions, f = _toy_policies()
    exact = float((logp_target.exp() * f).sum())
    g = torch.Generator().manual_seed(7)
    counts, t = [1200, 800, 2000], 8  # samples per version, tokens per sample (iid per token)
    tokens = [
        torch.multinomial(logp_versions[k].exp(), n * t, replacement=True, generator=g).view(n, t)
        for k, n in enumerate(counts)
    ]
    y = torch.cat(tokens)  # (N, T) all samples, grouped by version
    n_total = y.shape[0]
    logp_by_version = logp_versions[:, y]  # (K, N, T) log pi_k(y) for every k
    alpha = version_alpha(torch.tensor(counts) * t)
    log_q = mixture_log_density(logp_by_version, alpha)  # (N, T)
    w = behavior_weights(logp_target[y], log_q, clip=None).double()  # (N, T)
    # exp/log in float32 inside behavior_weights: compare against the float64 ratio
    exact_w = torch.exp(logp_target[y] - log_q)
    torch.testing.assert_close(w, exact_w, rtol=1e-5, atol=0)
    values = exact_w * f[y]  # (N, T)
    estimate = float(values.sum() / values.numel())
    # stratified sampling: Var = sum_k (N_k T) Var_k / (N T)^2
    var, start = 0.0, 0
    for n in counts:
        stratum = values[start:start + n].flatten()
        var += stratum.numel() * float(stratum.var())
        start += n
    se = (var / values.numel() ** 2) ** 0.5
    assert n_total == sum(counts)
    assert abs(estimate - exact) < 4 * se, (estimate, exact, se)
    assert se < 0.05 * exact  # the test has power: 4 SE is a tight band


def test_mixture_with_one_version_is_ordinary_importance_sampling():
    logp_target, logp_versions, f = _toy_policies()
    g = torch.Generator().manual_seed(3)
    y = torch.multinomial(logp_versions[1].exp(), 4000, replacement=True, generator=g)[None]
    logp_by_version = logp_versions[:, y]  # (3, 1, 4000)
    log_q = mixture_log_density(logp_by_version, torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(log_q, logp_versions[1][y])
    w = behavior_weights(logp_target[y], log_q, clip=None).double()
    ordinary = torch.exp(logp_target[y] - logp_versions[1][y])
    torch.testing.assert_close(w, ordinary, rtol=1e-5, atol=0)
    exact = float((logp_target.exp() * f).sum())
    est = float((ordinary * f[y]).mean())
    se = float((ordinary * f[y]).std()) / 4000**0.5
    assert abs(est - exact) < 4 * se


def _random_batch(n=6, t=5, versions=(3, 4, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    logp_by_version = -torch.rand(len(versions), n, t, generator=g) * 3  # (K, N, T)
    logp_current = -torch.rand(n, t, generator=g) * 3
    mask = torch.rand(n, t, generator=g) > 0.2
    mask[:, 0] = True
    return logp_current, logp_by_version, torch.tensor(versions), mask


def test_one_version_in_batch_darl_equals_decoupled():
    lc, lpv, versions, mask = _random_batch()
    bv = torch.full((lc.shape[0],), 4)  # every sample from version 4
    darl = batch_behavior_weights("darl", lc, lpv, versions, bv, mask, clip=2.0)
    dec = batch_behavior_weights("decoupled", lc, lpv, versions, bv, mask, clip=2.0)
    torch.testing.assert_close(darl.weights, dec.weights, rtol=1e-6, atol=0)
    assert torch.equal(darl.logp_base, dec.logp_base)
    adv = torch.linspace(-1, 1, lc.shape[0])
    logp_new = (lc + 0.1).requires_grad_()
    l1, _ = policy_loss(logp_new, darl.logp_base, darl.weights, adv, mask)
    l2, _ = policy_loss(logp_new, dec.logp_base, dec.weights, adv, mask)
    torch.testing.assert_close(l1, l2)
    # with versions mixed the two differ (the test above is not vacuous)
    mixed = batch_behavior_weights("darl", lc, lpv, versions, torch.tensor([3, 4, 5] * 2), mask)
    assert not torch.allclose(mixed.weights, dec.weights)


def test_on_policy_gradient_equals_grpo_policy_gradient():
    g = torch.Generator().manual_seed(5)
    n, t = 8, 6
    theta = torch.randn(t, VOCAB, generator=g, requires_grad=True)  # (T, V) toy policy
    y = torch.randint(0, VOCAB, (n, t), generator=g)
    mask = torch.rand(n, t, generator=g) > 0.3
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    adv = grpo_advantages(rewards, torch.arange(n) // 4)

    def logp_of(params):  # (N, T) log pi(y_ij)
        return torch.log_softmax(params, dim=-1)[torch.arange(t), y]

    logp = logp_of(theta)
    frozen = logp.detach()
    lpv = frozen.expand(3, n, t).clone()  # every version equals the target: w = 1
    bw = batch_behavior_weights("darl", frozen, lpv, torch.tensor([1, 2, 3]),
                                torch.tensor([1, 2, 3, 1, 2, 3, 1, 2]), mask, clip=2.0)
    assert torch.allclose(bw.weights[mask], torch.ones(()))
    loss, stats = policy_loss(logp, bw.logp_base, bw.weights, adv, mask)
    (grad_loss,) = torch.autograd.grad(loss, theta)
    grpo = -(adv[:, None] * logp_of(theta) * mask).sum() / mask.sum()
    (grad_grpo,) = torch.autograd.grad(grpo, theta)
    torch.testing.assert_close(grad_loss, grad_grpo)
    assert grad_grpo.abs().sum() > 0
    assert stats.clip_frac_low.item() == 0 and stats.clip_frac_high.item() == 0
