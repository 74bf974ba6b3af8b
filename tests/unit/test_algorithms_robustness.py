"""Property tests: the algorithm functions stay finite on the inputs a real run produces.

Log-ratios up to +-50, empty masks, one-token responses, padding that holds ``-inf``, and groups
with equal rewards (advantage exactly zero).
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_darl.algorithms import (
    Variant,
    batch_behavior_weights,
    grpo_advantages,
    policy_loss,
    score_samples,
)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
log_ratio = st.floats(min_value=-50.0, max_value=50.0, allow_nan=False)


@st.composite
def batches(draw):
    """(N, T) log-ratio batch with a random mask (possibly empty, possibly one token)."""
    n = draw(st.integers(1, 4))
    t = draw(st.integers(1, 5))
    ratios = torch.tensor(draw(st.lists(log_ratio, min_size=n * t, max_size=n * t)))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n * t, max_size=n * t)))
    base = torch.tensor(draw(st.lists(st.floats(-30.0, 0.0), min_size=n * t, max_size=n * t)))
    rewards = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)))
    return ratios.view(n, t), mask.view(n, t), base.view(n, t), rewards


def _pad_with_inf(x, mask):
    return torch.where(mask, x, torch.full_like(x, float("-inf")))


@SETTINGS
@given(batches())
def test_scores_finite(batch):
    ratios, mask, base, _ = batch
    lc = _pad_with_inf(base + ratios, mask)
    lb = _pad_with_inf(base, mask)
    for kind in ("chi2", "kl", "ess", "random"):
        s = score_samples(kind, lc, lb, mask)
        assert torch.isfinite(s).all(), kind
        assert (s >= 0).all(), kind
        assert (s[mask.sum(1) == 0] == 0).all() or kind == "random"


@SETTINGS
@given(batches(), st.sampled_from(list(Variant)), st.sampled_from([2.0, None]))
def test_weights_and_loss_finite_with_finite_gradient(batch, variant, clip):
    ratios, mask, base, rewards = batch
    n = ratios.shape[0]
    versions = torch.tensor([0, 1])
    behavior = torch.arange(n) % 2
    lpv = torch.stack([base, base - ratios.flip(0)])  # (2, N, T) two behavior versions
    lpv = _pad_with_inf(lpv, mask.expand(2, *mask.shape))
    lc = _pad_with_inf((base + ratios).clamp(max=0.0), mask)
    bw = batch_behavior_weights(variant, lc, lpv, versions, behavior, mask, clip=clip)
    assert torch.isfinite(bw.weights).all()
    adv = grpo_advantages(rewards, torch.zeros(n, dtype=torch.int64))
    logp_new = _pad_with_inf(lc + ratios.flip(1), mask).requires_grad_()
    loss, stats = policy_loss(logp_new, bw.logp_base, bw.weights, adv, mask, 0.2, 0.28)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logp_new.grad).all()
    assert all(math.isfinite(v) for v in stats.as_dict().values())
    if not mask.any():
        assert loss.item() == 0.0


@SETTINGS
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=16), st.integers(1, 4))
def test_equal_rewards_give_exactly_zero_advantage(values, copies):
    # group i holds `copies` samples that all have reward values[i]
    rewards = torch.tensor(values * copies, dtype=torch.float32)
    index = torch.arange(len(values)).repeat(copies)
    adv = grpo_advantages(rewards, index)
    assert torch.equal(adv, torch.zeros_like(adv))


@SETTINGS
@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=16))
def test_advantages_finite_and_centred(values):
    rewards = torch.tensor(values, dtype=torch.float32)
    adv = grpo_advantages(rewards, torch.zeros(len(values), dtype=torch.int64))
    assert torch.isfinite(adv).all()
    assert abs(float(adv.double().sum())) < 1e-3 * len(values)
