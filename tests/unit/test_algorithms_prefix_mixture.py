"""The multi-behavior weight of a multi-token response: the sequence mixture's conditional.

A batch whose responses were drawn whole from versions k (in shares alpha_k) is a draw from the
sequence mixture q(y) = sum_k alpha_k pi_k(y). Weighting each token by pi_t(y_j | y_<j) /
q(y_j | y_<j) gives, at every position j, an unbiased estimate of the quantity the token-level
surrogate targets, E_{y_<j ~ q} E_{y_j ~ pi_t(.|y_<j)} f(y_<=j), only when q(y_j | y_<j) is the
mixture's true conditional (``form="prefix"``). The mixture of per-token conditionals
(``form="token"``) keeps alpha at every token, ignores what the prefix says about the version,
and is biased from the second token on. Monte Carlo over order-1 Markov policies of a 4-token
vocabulary (exact values by forward recursion), then the numerics of 8k-token prefixes.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_darl.algorithms import batch_behavior_weights, prefix_mixture_log_density

VOCAB = 4


def _policies(seed: int = 11):
    """Target and three versions: log pi(y_j | position j, previous token), (P, L, V, V)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 8, VOCAB, VOCAB, generator=g, dtype=torch.float64)
    drift = 1.5 * torch.randn(3, 8, VOCAB, VOCAB, generator=g, dtype=torch.float64)
    logits = torch.cat([base, base + drift])  # target, then versions far from it and each other
    return torch.log_softmax(logits, dim=-1)  # (4, 8, V, V): [policy, position, previous, next]


def _f(length: int) -> torch.Tensor:
    """f(position, previous, token), (L, V, V): a payoff that depends on the prefix."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(length, VOCAB, VOCAB, generator=g, dtype=torch.float64)


def _sample(logp: torch.Tensor, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    """``n`` responses of ``length`` tokens from one Markov policy (token -1: a fixed start 0)."""
    y = torch.zeros(n, length, dtype=torch.int64)
    prev = torch.zeros(n, dtype=torch.int64)
    for j in range(length):
        y[:, j] = torch.multinomial(logp[j, prev].exp(), 1, generator=g)[:, 0]
        prev = y[:, j]
    return y


def _token_logp(logp: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(N, L) log pi(y_j | y_j-1) of one policy along each response."""
    prev = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)
    pos = torch.arange(y.shape[1]).expand_as(y)
    return logp[pos, prev, y]


def _exact(policies: torch.Tensor, alpha: torch.Tensor, f: torch.Tensor) -> float:
    """sum_j E_{y_<j ~ q} sum_y pi_t(y | y_j-1) f(j, y_j-1, y): q is linear in alpha, so the
    prefix enters through each version's marginal of the previous token."""
    target, versions = policies[0], policies[1:]
    length = f.shape[0]
    gain = (target[:length].exp() * f).sum(-1)  # (L, V): the target's expected f given the previous
    total = 0.0
    for k, a in enumerate(alpha.tolist()):
        marginal = torch.zeros(VOCAB, dtype=torch.float64)
        marginal[0] = 1.0  # the start token
        for j in range(length):
            total += a * float(marginal @ gain[j])
            marginal = marginal @ versions[k, j].exp()  # next token's marginal under version k
    return total


@pytest.mark.parametrize("length", [2, 3, 5])
def test_only_the_prefix_form_is_unbiased_over_multi_token_responses(length):
    policies = _policies()
    f = _f(length)
    counts = [15000, 5000, 10000]  # responses per version; one length: the token share is alpha
    alpha = torch.tensor(counts, dtype=torch.float64) / sum(counts)
    exact = _exact(policies, alpha, f)
    g = torch.Generator().manual_seed(100 + length)
    y = torch.cat([_sample(policies[1 + k], n, length, g) for k, n in enumerate(counts)])  # (N, L)
    versions = torch.arange(1, 4)
    behavior = torch.repeat_interleave(versions, torch.tensor(counts))  # (N,)
    by_version = torch.stack([_token_logp(policies[1 + k], y) for k in range(3)])  # (3, N, L)
    target = _token_logp(policies[0], y)
    prev = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)
    payoff = f[torch.arange(length).expand_as(y), prev, y]  # (N, L)
    mask = torch.ones_like(y, dtype=torch.bool)
    results = {}
    for form in ("prefix", "token"):
        w = batch_behavior_weights("darl", target, by_version, versions, behavior, mask, clip=None,
                                   form=form).weights.double()
        per_response = (w * payoff).sum(1)  # (N,) independent given the version (stratified)
        strata = per_response.split(counts)
        estimate = float(per_response.mean())
        se = math.sqrt(sum(len(s) * float(s.var()) for s in strata)) / len(per_response)
        results[form] = (estimate, se)
    est, se = results["prefix"]
    assert abs(est - exact) < 4 * se, (results, exact)  # 4 SE: a false alarm about 1 in 16,000
    est, se = results["token"]
    assert abs(est - exact) > 8 * se, (results, exact)  # the per-token mixture misses by far more


def test_the_first_token_is_the_same_in_both_forms():
    policies = _policies()
    g = torch.Generator().manual_seed(3)
    y = torch.cat([_sample(policies[1 + k], 50, 4, g) for k in range(3)])
    by_version = torch.stack([_token_logp(policies[1 + k], y) for k in range(3)])
    alpha = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    prefix = prefix_mixture_log_density(by_version, alpha)
    token = torch.logsumexp(by_version + alpha.log()[:, None, None], dim=0)
    torch.testing.assert_close(prefix[:, 0], token[:, 0])
    assert (prefix[:, 1:] - token[:, 1:]).abs().max() > 0.05
    # one version: both are that version's own conditional
    one = prefix_mixture_log_density(by_version, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(one, by_version[1])


def _alternating(n: int, phase: int) -> torch.Tensor:
    """log 0.5 at even tokens and log 0.25 at odd ones (shifted by ``phase``), float32."""
    j = torch.arange(n) + phase
    return torch.where(j % 2 == 0, torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25)))


def test_prefixes_of_8k_tokens_are_exact_in_float32_and_the_cap_applies_per_token():
    """Two packed responses of 8192 tokens; version A gives its tokens 0.5 and 0.25 in turn,
    version B the other way round. Prefix log-densities reach -8,500 nats, where exp underflows
    and a difference of two prefix log-sum-exps in float32 loses the answer. Known answer: after
    an even number of tokens both versions are equally likely (posterior alpha), after an odd
    one A's is 2 alpha_A / (2 alpha_A + alpha_B)."""
    n, alpha_a = 8192, 0.25
    a = torch.cat([_alternating(n, 0), _alternating(n, 0)])  # (2n,) float32
    b = torch.cat([_alternating(n, 1), _alternating(n, 1)])
    by_version = torch.stack([a, b])  # (2, 2n)
    sample = torch.repeat_interleave(torch.arange(2), n)
    alpha = torch.tensor([alpha_a, 1 - alpha_a], dtype=torch.float64)
    log_q = prefix_mixture_log_density(by_version, alpha, sample_index=sample)
    assert log_q.dtype == torch.float32 and bool(torch.isfinite(log_q).all())
    even = alpha_a * 0.5 + (1 - alpha_a) * 0.25  # q at an even position: posterior alpha
    post = 2 * alpha_a / (2 * alpha_a + (1 - alpha_a))  # A's posterior after one token
    odd = post * 0.25 + (1 - post) * 0.5
    want = torch.tensor([math.log(even), math.log(odd)] * n, dtype=torch.float32)
    torch.testing.assert_close(log_q, want, rtol=0, atol=1e-6)
    # the cap: the target gives every token 0.7, so w = 0.7 / q exceeds c = 2 where q < 0.35:
    # at the even positions (q = 0.3125), not at the odd ones (q = 0.4)
    target = torch.full((2 * n,), math.log(0.7))
    bw = batch_behavior_weights("darl", target, by_version, torch.tensor([0, 1]),
                                torch.repeat_interleave(torch.tensor([0, 1]), n),
                                torch.ones(2 * n, dtype=torch.bool), clip=2.0, sample_index=sample,
                                version_tokens=alpha * 2 * n)  # alpha over the whole batch: (0.25, 0.75)
    ratio = 0.7 / torch.tensor([even, odd] * n)
    torch.testing.assert_close(bw.weights, ratio.clamp(max=2.0).float(), rtol=1e-5, atol=0)
    assert torch.equal(bw.capped, ratio > 2.0) and int(bw.capped.sum()) == n


def test_packed_prefix_weights_need_the_response_of_each_token():
    by_version = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="sample_index"):
        batch_behavior_weights("darl", torch.zeros(5), by_version, torch.tensor([0, 1]),
                               torch.tensor([0, 0, 1, 1, 1]), torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="non-decreasing"):
        prefix_mixture_log_density(by_version, torch.tensor([0.5, 0.5]), sample_index=torch.tensor([0, 1, 0, 1, 1]))
