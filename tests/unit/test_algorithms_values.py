"""Hand-computed values for every function of megatron_darl.algorithms (docs/algorithm.md)."""

import math

import pytest
import torch

from megatron_darl.algorithms import (
    SCORES,
    VARIANTS,
    RatioBase,
    ScoreKind,
    Variant,
    WeightRule,
    batch_behavior_weights,
    behavior_weights,
    capped_tokens,
    ess_score,
    group_scores,
    grpo_advantages,
    kl_score,
    mixture_log_density,
    needs_logprob_pass,
    policy_loss,
    score_samples,
    score_tokens,
    select_groups,
    variance_score,
    variant_spec,
    version_alpha,
    with_rollout_is,
)

LN = math.log


def test_grpo_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 5.0, 3.0, 1.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 9, 0, 0])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    a = 0.5 / math.sqrt(1.0 / 3.0)  # mean 0.5, unbiased std sqrt(1/3)
    b = 1.0 / math.sqrt(2.0)  # rewards 3, 1: mean 2, unbiased std sqrt(2)
    expected = torch.tensor([a, -a, a, -a, 0.0, 0.0, 0.0, b, -b])
    torch.testing.assert_close(adv, expected)
    assert adv.dtype == torch.float32
    assert torch.all(adv[4:7] == 0)  # equal rewards and a group of one: exactly zero


def test_grpo_advantages_equal_awkward_rewards_are_exactly_zero():
    adv = grpo_advantages(torch.full((16,), 0.1), torch.zeros(16, dtype=torch.int64))
    assert torch.all(adv == 0)


def test_grpo_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match="group_index"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.int64))


def _two_samples():
    # sample 0: ratios 2, 1 (third token masked, holds -inf); sample 1: ratio 3; sample 2: empty
    lb = torch.zeros(3, 3)
    lc = torch.tensor([[LN(2), 0.0, float("-inf")], [LN(3), 0, 0], [5.0, 5, 5]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    return lc, lb, mask


def test_variance_score_hand_values():
    lc, lb, mask = _two_samples()
    s = variance_score(lc, lb, mask)
    torch.testing.assert_close(s, torch.tensor([0.5, 4.0, 0.0], dtype=torch.float64))


def test_kl_score_hand_values():
    lc, lb, mask = _two_samples()
    s = kl_score(lc, lb, mask)
    expected = torch.tensor([(1 - LN(2)) / 2, 2 - LN(3), 0.0], dtype=torch.float64)
    torch.testing.assert_close(s, expected)


def test_ess_score_hand_values():
    lc, lb, mask = _two_samples()
    s = ess_score(lc, lb, mask)
    # sample 0: ratios (2, 1): ESS = 9 / 5 = 1.8 of n = 2 -> 1 - 0.9; one token -> ESS = n
    torch.testing.assert_close(s, torch.tensor([0.1, 0.0, 0.0], dtype=torch.float64))


def test_score_registry_dispatch_fifo_and_random():
    lc, lb, mask = _two_samples()
    torch.testing.assert_close(score_samples("chi2", lc, lb, mask), variance_score(lc, lb, mask))
    torch.testing.assert_close(score_samples(ScoreKind.KL, lc, lb, mask), kl_score(lc, lb, mask))
    fifo = score_samples("fifo", lc, lb, mask, behavior_version=torch.tensor([3, 5, 4]))
    assert fifo.tolist() == [-3.0, -5.0, -4.0]
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    r1 = score_samples("random", lc, lb, mask, generator=g1)
    assert torch.equal(r1, score_samples("random", lc, lb, mask, generator=g2))
    assert r1.shape == (3,) and bool(((r1 >= 0) & (r1 < 1)).all())
    with pytest.raises(ValueError, match="behavior_version"):
        score_samples("fifo", lc, lb, mask)
    with pytest.raises(ValueError, match="unknown score"):
        score_samples("nope", lc, lb, mask)
    assert set(SCORES) == set(ScoreKind)  # one registry covers every score


def test_group_scores_token_weighted():
    s = torch.tensor([0.5, 4.0, 0.0, 2.0])
    n = torch.tensor([2, 1, 0, 0])
    g = group_scores(s, n, torch.tensor([0, 0, 1, 1]), 2)
    # group 0: (2 * 0.5 + 1 * 4) / 3; group 1 has no tokens -> plain mean 1.0
    torch.testing.assert_close(g, torch.tensor([5.0 / 3.0, 1.0], dtype=torch.float64))


def test_version_alpha_and_mixture_log_density():
    alpha = version_alpha(torch.tensor([1, 3, 0]))
    torch.testing.assert_close(alpha, torch.tensor([0.25, 0.75, 0.0], dtype=torch.float64))
    logp = torch.log(torch.tensor([[[0.2, 0.4]], [[0.6, 0.4]], [[float("nan")] * 2]]))  # (3,1,2)
    log_q = mixture_log_density(logp, alpha)
    torch.testing.assert_close(log_q, torch.log(torch.tensor([[0.5, 0.4]])))
    with pytest.raises(ValueError, match="alpha"):
        mixture_log_density(logp, torch.tensor([0.5, 0.7, 0.0]))
    with pytest.raises(ValueError, match="version_tokens"):
        version_alpha(torch.tensor([0, 0]))


def test_behavior_weights_clip_mask_and_no_grad():
    lc = torch.log(torch.tensor([[0.8, 0.9, 0.1]])).requires_grad_()
    log_q = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    mask = torch.tensor([[1, 1, 0]])
    w = behavior_weights(lc, log_q, clip=2.0, mask=mask)
    torch.testing.assert_close(w, torch.tensor([[1.6, 2.0, 0.0]]))
    assert not w.requires_grad
    w_none = behavior_weights(lc, log_q, clip=None)
    torch.testing.assert_close(w_none, torch.tensor([[1.6, 3.0, 0.5]]))
    big = behavior_weights(torch.tensor([[50.0]]), torch.tensor([[0.0]]), clip=2.0)
    assert big.item() == 2.0
    with pytest.raises(ValueError, match="clip"):
        behavior_weights(lc, log_q, clip=0.0)


def test_behavior_weights_mask_mode_drops_tokens_over_the_cap():
    # ratios 1.6, 3.0, 0.5 (masked), 1.95 (under the cap: kept)
    lc = torch.log(torch.tensor([[0.8, 0.9, 0.1, 0.39]]))
    log_q = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.2]]))
    mask = torch.tensor([[1, 1, 0, 1]])
    w = behavior_weights(lc, log_q, clip=2.0, mask=mask, cap_mode="mask")
    torch.testing.assert_close(w, torch.tensor([[1.6, 0.0, 0.0, 1.95]]))
    assert capped_tokens(lc, log_q, 2.0, mask).tolist() == [[False, True, False, False]]
    assert behavior_weights(torch.tensor([[90.0]]), torch.tensor([[0.0]]), 2.0, cap_mode="mask").item() == 0.0
    torch.testing.assert_close(behavior_weights(lc, log_q, None, cap_mode="mask")[0, 1], torch.tensor(3.0))
    with pytest.raises(ValueError, match="cap_mode"):
        behavior_weights(lc, log_q, clip=2.0, cap_mode="cut")


def _loss_batch():
    lp = torch.tensor([[LN(1.5), LN(0.5)], [LN(1.1), 0.0], [LN(0.5), 0.0]])
    logp_new = lp.clone().requires_grad_()
    prox = torch.zeros(3, 2)
    weights = torch.tensor([[1.0, 2.0], [0.5, 9.0], [1.0, 9.0]])
    adv = torch.tensor([1.0, -1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]], dtype=torch.bool)
    return logp_new, prox, weights, adv, mask


def test_policy_loss_hand_values_and_gradient():
    logp_new, prox, weights, adv, mask = _loss_batch()
    loss, stats = policy_loss(logp_new, prox, weights, adv, mask, clip_low=0.2, clip_high=0.2)
    # tokens: -1*1.2 (clipped high), -2*0.5, -0.5*(-1.1), -1*(-0.8) (clipped low); 4 tokens
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.55 + 0.8) / 4)
    loss.backward()
    # d/dlogp of -w*rho*A/4 where unclipped, 0 where the clipped branch is taken
    expected = torch.tensor([[0.0, -2 * 0.5 / 4], [0.5 * 1.1 / 4, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(logp_new.grad, expected)
    d = stats.as_dict()
    assert d["clip_frac_low"] == pytest.approx(0.25)
    assert d["clip_frac_high"] == pytest.approx(0.25)
    assert d["weight_ess"] == pytest.approx(4.5**2 / (4 * 6.25))
    assert d["mean_weight"] == pytest.approx(1.125)
    assert d["max_weight"] == pytest.approx(2.0)
    assert d["mean_ratio"] == pytest.approx(0.9)
    assert d["num_tokens"] == 4


def test_policy_loss_num_tokens_normaliser_and_asymmetric_clip():
    logp_new, prox, weights, adv, mask = _loss_batch()
    loss_8, _ = policy_loss(logp_new, prox, weights, adv, mask, num_tokens=8)
    assert loss_8.item() == pytest.approx((-1.2 - 1.0 + 0.55 + 0.8) / 8)
    loss_hi, stats = policy_loss(logp_new, prox, weights, adv, mask, clip_high=0.6)
    assert loss_hi.item() == pytest.approx((-1.5 - 1.0 + 0.55 + 0.8) / 4)
    assert stats.clip_frac_high.item() == 0.0


def test_policy_loss_empty_mask_is_zero_with_zero_gradient():
    logp_new = torch.full((2, 3), float("-inf"), requires_grad=True)
    zeros = torch.zeros(2, 3)
    loss, stats = policy_loss(logp_new, zeros, zeros, torch.ones(2), zeros.bool())
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp_new.grad, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in stats.as_dict().values())


def test_oldest_score_consumes_the_backlog_in_generation_order():
    """``oldest`` takes the lowest behavior versions first (``fifo`` the highest), so an async
    trainer with a backlog of eta versions trains every sample eta versions stale."""
    lc, lb, mask = _two_samples()
    versions = torch.tensor([3, 5, 4])
    oldest = score_samples("oldest", lc, lb, mask, behavior_version=versions)
    assert oldest.tolist() == [3.0, 5.0, 4.0]
    pick = select_groups(oldest, torch.ones(3, dtype=torch.bool), 2, versions.double())
    assert pick.tolist() == [0, 2]
    fifo = score_samples("fifo", lc, lb, mask, behavior_version=versions)
    assert select_groups(fifo, torch.ones(3, dtype=torch.bool), 2, versions.double()).tolist() == [1, 2]
    with pytest.raises(ValueError, match="required for the oldest score"):
        score_samples("oldest", lc, lb, mask)


def test_select_groups_lowest_first_ties_to_fresher():
    scores = torch.tensor([0.3, 0.1, 0.1, 0.5, 0.0])
    eligible = torch.tensor([True, True, True, True, False])
    fresh = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    assert select_groups(scores, eligible, 3, fresh).tolist() == [2, 1, 0]
    assert select_groups(scores, eligible, 10, fresh).tolist() == [2, 1, 0, 3]
    assert select_groups(scores, eligible, 0, fresh).tolist() == []
    with pytest.raises(ValueError, match="NaN"):
        select_groups(torch.tensor([float("nan")]), torch.tensor([True]), 1, torch.zeros(1))


def test_variant_table_matches_design():
    assert {v.value for v in Variant} == {
        "sync", "async", "decoupled", "darl", "darl_nofilter", "darl_nomis"}
    sync, darl = VARIANTS[Variant.SYNC], variant_spec("darl")
    assert (sync.score, sync.weight_rule) == (ScoreKind.FIFO, WeightRule.NONE)
    assert (darl.score, darl.weight_rule) == (ScoreKind.CHI2, WeightRule.MIXTURE)
    assert variant_spec("async").ratio_base is RatioBase.BEHAVIOR
    assert variant_spec("async").weight_rule is WeightRule.NONE
    assert variant_spec("decoupled").weight_rule is WeightRule.OWN_BEHAVIOR
    assert variant_spec("darl_nofilter").score is ScoreKind.RANDOM
    assert variant_spec("darl_nomis").weight_rule is WeightRule.OWN_BEHAVIOR
    with pytest.raises(ValueError, match="darl"):
        variant_spec("ppo")


def _batch():
    """Two samples, versions 3 and 4, lengths 1 and 3: alpha = (0.25, 0.75)."""
    p3 = torch.tensor([[0.2, 0.0, 0.0], [0.5, 0.5, 0.5]])
    p4 = torch.tensor([[0.6, 0.0, 0.0], [0.25, 0.25, 0.5]])
    logp_by_version = torch.log(torch.stack([p3, p4]))  # (2, 2, 3); masked slots are -inf
    logp_current = torch.log(torch.tensor([[0.8, 1.0, 1.0], [0.5, 0.1, 0.75]]))
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    return logp_current, logp_by_version, torch.tensor([3, 4]), torch.tensor([3, 4]), mask


def test_batch_behavior_weights_per_variant():
    lc, lpv, versions, bv, mask = _batch()
    darl = batch_behavior_weights("darl", lc, lpv, versions, bv, mask, clip=2.0)
    torch.testing.assert_close(darl.alpha, torch.tensor([0.25, 0.75], dtype=torch.float64))
    # the sequence mixture's conditional: the posterior of (v3, v4) given the prefix is (0.25,
    # 0.75) at a first token, then (0.4, 0.6) after sample 1's first token (0.25 x 0.5 against
    # 0.75 x 0.25), then (4/7, 3/7): q = 0.5; 0.3125, 0.35, 0.5
    torch.testing.assert_close(darl.weights, torch.tensor([[1.6, 0, 0], [1.6, 0.1 / 0.35, 1.5]]))
    # the mixture of per-token conditionals keeps alpha at every token: 0.3125 at sample 1's second
    token = batch_behavior_weights("darl", lc, lpv, versions, bv, mask, clip=2.0, form="token")
    torch.testing.assert_close(token.weights, torch.tensor([[1.6, 0, 0], [1.6, 0.32, 1.5]]))
    assert torch.equal(darl.logp_base, lc)
    own = batch_behavior_weights("decoupled", lc, lpv, versions, bv, mask, clip=2.0)
    torch.testing.assert_close(own.weights, torch.tensor([[2.0, 0, 0], [2.0, 0.4, 1.5]]))
    naive = batch_behavior_weights("async", lc, lpv, versions, bv, mask)
    assert torch.equal(naive.weights, mask.float())
    # naive async: the ratio base is each sample's own (engine) behavior row
    torch.testing.assert_close(naive.logp_base[0, 0], torch.tensor(LN(0.2)))
    torch.testing.assert_close(naive.logp_base[1], lpv[1, 1])


def test_batch_behavior_weights_cap_mode_and_capped_tokens():
    lc, lpv, versions, bv, mask = _batch()
    masked = batch_behavior_weights("decoupled", lc, lpv, versions, bv, mask, clip=1.8, cap_mode="mask")
    # own-behavior ratios: sample 0: 4.0; sample 1: 2.0, 0.4, 1.5 -> over the cap 1.8: masked
    torch.testing.assert_close(masked.weights, torch.tensor([[0.0, 0, 0], [0.0, 0.4, 1.5]]))
    assert masked.capped.tolist() == [[True, False, False], [True, False, False]]
    clipped = batch_behavior_weights("decoupled", lc, lpv, versions, bv, mask, clip=1.8)
    torch.testing.assert_close(clipped.weights, torch.tensor([[1.8, 0, 0], [1.8, 0.4, 1.5]]))
    assert torch.equal(clipped.capped, masked.capped)
    assert not batch_behavior_weights("async", lc, lpv, versions, bv, mask).capped.any()


def test_rollout_is_and_logprob_pass_needs():
    assert not needs_logprob_pass(variant_spec("async"))  # fifo, no weights, ratio vs mu
    for name in ("sync", "decoupled", "darl", "darl_nofilter", "darl_nomis"):
        assert needs_logprob_pass(variant_spec(name)), name
    tis = with_rollout_is(variant_spec("async"))
    assert needs_logprob_pass(tis) and tis.score is ScoreKind.FIFO
    lc, lpv, versions, bv, mask = _batch()
    got = batch_behavior_weights(tis, lc, lpv, versions, bv, mask, clip=2.0)
    ref = batch_behavior_weights("decoupled", lc, lpv, versions, bv, mask, clip=2.0)
    assert torch.equal(got.weights, ref.weights) and torch.equal(got.logp_base, lc)
    with pytest.raises(ValueError, match="mis.clip"):
        with_rollout_is(variant_spec("darl"))


def test_batch_behavior_weights_refuses_missing_mixture_rows():
    lc, lpv, versions, bv, mask = _batch()
    lpv[0, 1, 0] = float("-inf")  # version 3 missing for sample 1 at a real token
    with pytest.raises(ValueError, match="version 3"):
        batch_behavior_weights("darl", lc, lpv, versions, bv, mask)
    with pytest.raises(ValueError, match="not in versions"):
        batch_behavior_weights("darl", lc, lpv, torch.tensor([5, 4]), bv, mask)


def test_the_packed_layout_gives_the_padded_values():
    """The loop's packed layout ((n,) tokens end to end, per-token advantages and versions)
    computes exactly what the padded (N, T) rows give, for scores, weights and the loss."""
    lc, lpv, versions, bv, mask = _batch()
    lens = mask.sum(1)  # (2,) 1 and 3 tokens
    index = torch.repeat_interleave(torch.arange(2), lens)  # (n,)
    lb = lpv[0]  # any behavior rows
    for kind in ("chi2", "kl", "ess", "fifo"):
        padded = score_samples(kind, lc, lb, mask, behavior_version=bv)
        packed = score_tokens(kind, lc[mask], lb[mask], index, 2, behavior_version=bv)
        torch.testing.assert_close(packed, padded, rtol=0, atol=1e-12)
    for variant in ("darl", "decoupled", "async"):
        want = batch_behavior_weights(variant, lc, lpv, versions, bv, mask, clip=2.0)
        got = batch_behavior_weights(variant, lc[mask], lpv[:, mask], versions, bv[index],
                                     torch.ones(int(lens.sum()), dtype=torch.bool), clip=2.0,
                                     sample_index=index)
        assert torch.equal(got.weights, want.weights[mask]) and torch.equal(got.logp_base, want.logp_base[mask])
        torch.testing.assert_close(got.alpha, want.alpha)
    logp_new, prox, weights, adv, lmask = _loss_batch()
    want, want_stats = policy_loss(logp_new, prox, weights, adv, lmask)
    per_token = adv.repeat_interleave(lmask.sum(1))
    flat = logp_new.detach()[lmask].clone().requires_grad_()
    got, got_stats = policy_loss(flat, prox[lmask], weights[lmask], per_token)  # no mask: all tokens
    assert got.item() == pytest.approx(want.item())
    assert got_stats.as_dict() == pytest.approx(want_stats.as_dict())
    want.backward()
    got.backward()
    torch.testing.assert_close(flat.grad, logp_new.grad[lmask])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(flat, prox[lmask], weights[lmask], adv)  # 3 per-sample values for 4 tokens
