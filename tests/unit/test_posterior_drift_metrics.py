"""benchmarks/posterior_drift.py's per-case metrics: a biased engine source tips only the
two-source posterior, and the forms' ESS order follows the weights."""

import torch

from benchmarks.posterior_drift import case_metrics


def test_a_biased_engine_tips_the_two_source_posterior_only():
    gen = torch.Generator().manual_seed(0)
    n, length = 4, 3000
    pi0 = -torch.rand(n * length, generator=gen) * 3  # trainer rows of version 0
    mu0 = pi0 + 2e-3  # the engine's rows: 2e-3 nats a token above the trainer's
    index = torch.arange(n).repeat_interleave(length)
    position = torch.arange(length).repeat(n)
    m = case_metrics(mu0, pi0, pi0, index, position)  # two identical versions
    assert abs(m["own_posterior_one_source_2048"] - 0.5) < 1e-9
    assert m["own_posterior_two_source_0"] < m["own_posterior_two_source_2048"]
    assert m["own_posterior_two_source_last"] > 0.99  # sigmoid(2e-3 x 3000 = 6 nats)
    assert m["ess_prefix"] > 0.999 and m["ess_own"] > 0.999  # w = exp(-2e-3): all equal
    drifted = pi0 + 0.3 * torch.randn(n * length, generator=gen)  # version 1 far from 0
    m = case_metrics(mu0, pi0, drifted, index, position)
    assert m["ess_own"] < m["ess_prefix"] <= 1.0  # the mixture's weights vary less than own-behavior's
