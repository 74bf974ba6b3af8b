"""The optional loss terms (entropy bonus, KL to the initial policy): values and gradients against a
direct computation, the default (both off) bitwise the plain policy loss, and the reference rows
a step attaches to its mini-batches (real planner, buffer and samples; a deterministic trainer)."""

import dataclasses

import pytest
import torch

from megatron_darl.algorithms import (
    KLEstimator, PolicyLossInputs, RegularizedLossInputs, kl_estimate, policy_loss, regularizer_loss,
)
from megatron_darl.step.config import AlgorithmConfig, ReplayConfig
from megatron_darl.step.planner import ShardPlanner
from megatron_darl.step.regularize import (
    REFERENCE_VERSION, TRAINED_SHARE, ReferenceRows, regularized_loss_fn, term_stats, terms_on,
)
from megatron_darl.step.runner import loss_fn_for
from megatron_darl.trainer.batch import TrainBatch
from tests.unit.test_step_planner import fake_logprobs, make_group, true_logp


def _tokens(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ref = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    ent = (torch.rand(n, generator=g, dtype=torch.float64) * 2).requires_grad_()
    return logp, ref, ent


def test_kl_estimators_match_verl_definitions_and_gradients():
    logp, ref, _ = _tokens()
    d = logp.detach() - ref
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), logp - ref)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * (logp - ref) ** 2)
    k3 = kl_estimate(logp, ref, KLEstimator.K3)
    torch.testing.assert_close(k3, torch.exp(-d) + d - 1, atol=1e-15, rtol=0)  # r - log r - 1, r = ref/pi
    assert (k3 >= 0).all()
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    torch.testing.assert_close(grad, 1 - torch.exp(-d))  # d/dlogp (e^{-d} + d - 1); ref gets none
    (grad2,) = torch.autograd.grad(kl_estimate(logp, ref, "k2").sum(), logp)
    torch.testing.assert_close(grad2, d)
    far = kl_estimate(torch.tensor([-40.0, 0.0]), torch.tensor([0.0, -40.0]), "k3")  # verl's clamps
    torch.testing.assert_close(far, torch.tensor([10.0, 10.0]))  # both ends capped at 10, never inf
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "low_var")


def test_regularizer_loss_values_and_gradients_against_direct_sums():
    logp, ref, ent = _tokens()
    mask = torch.ones(12)
    mask[-3:] = 0  # stand-in tokens: no term
    loss, stats = regularizer_loss(logp, ent, ref, mask, entropy_coef=0.01, kl_coef=0.1, estimator="k3",
                                   num_tokens=20.0)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    direct = (0.1 * (k3 * mask.double()).sum() - 0.01 * (ent * mask.double()).sum()) / 20.0
    torch.testing.assert_close(loss.double(), direct, atol=1e-7, rtol=0)
    g_logp, g_ent = torch.autograd.grad(loss, (logp, ent))
    d_logp, d_ent = torch.autograd.grad(direct, (logp, ent))
    torch.testing.assert_close(g_logp, d_logp, atol=1e-7, rtol=0)
    torch.testing.assert_close(g_ent, d_ent, atol=1e-7, rtol=0)
    assert (g_logp[-3:] == 0).all() and (g_ent[-3:] == 0).all()
    torch.testing.assert_close(float(stats.entropy), float(ent[:9].detach().mean()), atol=1e-6, rtol=0)
    torch.testing.assert_close(float(stats.kl), float(k3[:9].detach().mean()), atol=1e-6, rtol=0)
    off, off_stats = regularizer_loss(logp, None, None)  # both off: exactly zero, no stats
    assert float(off) == 0.0 and float(off_stats.kl) == 0.0 and not off.requires_grad
    with pytest.raises(ValueError, match="entropy"):
        regularizer_loss(logp, None, ref, entropy_coef=0.1)
    with pytest.raises(ValueError, match="reference"):
        regularizer_loss(logp, ent, None, kl_coef=0.1)


def _slice_batch(n, inputs):
    ids = torch.arange(n + 1)
    return TrainBatch(ids, torch.tensor([n + 1]), torch.arange(n + 1) > 0, inputs)


def test_loss_fn_with_terms_adds_them_and_with_coefs_zero_is_bitwise_the_plain_loss():
    logp, ref, ent = _tokens(seed=1)
    g = torch.Generator().manual_seed(2)
    base = PolicyLossInputs(logp.detach().float() + 0.05 * torch.randn(12, generator=g),
                            torch.rand(12, generator=g) + 0.5, torch.randn(12, generator=g))
    assert not terms_on(AlgorithmConfig())  # the default runs the plain loss function
    plain = loss_fn_for(0.2, 0.2)
    lp = logp.detach().float().requires_grad_()
    loss_a, stats_a = plain(lp, _slice_batch(12, base))
    (grad_a,) = torch.autograd.grad(loss_a, lp)
    mask = torch.ones(12)
    mask[-2:] = 0
    full = RegularizedLossInputs(*dataclasses.astuple(base), mask, ref.float())
    zero = regularized_loss_fn(AlgorithmConfig())  # coefs 0: the same loss, bit for bit
    loss_b, stats_b = zero(lp, _slice_batch(12, full))
    (grad_b,) = torch.autograd.grad(loss_b, lp)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and stats_a == stats_b
    on = regularized_loss_fn(AlgorithmConfig(entropy_coef=0.01, kl_coef=0.1, kl_estimator="k1"))
    e = ent.detach().float().requires_grad_()
    loss_c, stats_c = on(lp, _slice_batch(12, full), e)
    pol, _ = policy_loss(lp, base.logp_base, base.weights, base.advantages, None, 0.2, 0.2, num_tokens=1.0)
    direct = pol + 0.1 * ((lp - ref.float()) * mask).sum() - 0.01 * (e * mask).sum()
    torch.testing.assert_close(loss_c, direct, atol=1e-6, rtol=0)
    terms = term_stats(stats_c)  # one micro-batch: the trainer's token-weighted mean is its own
    kl_mean = float(((lp.detach() - ref.float()) * mask).sum() / 10)
    torch.testing.assert_close(terms["kl_ref"], kl_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(terms["entropy"], float(e[:10].detach().mean()), atol=1e-6, rtol=0)
    assert TRAINED_SHARE not in terms


def _step_stats(records):
    """The trainer's reduction of micro-batch stats (``PolicyTrainer._step_result``): each stat's
    mean weighted by the micro-batch's tokens, stand-ins included."""
    total = sum(n for n, _ in records)
    return {k: sum(n * st[k] for n, st in records) / total for k in records[0][1]}


def test_the_terms_are_logged_over_the_trained_tokens_and_left_out_of_a_step_that_trained_none():
    """A micro-batch of stand-ins only (a DP shard short of groups) must not pull the step's
    entropy or KL towards 0, and a step of stand-ins only logs neither."""
    on = regularized_loss_fn(AlgorithmConfig(entropy_coef=0.01, kl_coef=0.1, kl_estimator="k1"))
    g = torch.Generator().manual_seed(3)
    pieces, records = [], []
    for n, trained in ((12, 9), (8, 0), (6, 6)):
        logp, ref, ent = _tokens(n, seed=n)
        base = PolicyLossInputs(logp.detach().float(), torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g))
        mask = (torch.arange(n) < trained).float()
        inputs = RegularizedLossInputs(*dataclasses.astuple(base), mask, ref.float())
        _, stats = on(logp.detach().float(), _slice_batch(n, inputs), ent.detach().float())
        records.append((n, stats))
        pieces.append((ent[:trained].detach(), (logp.detach() - ref)[:trained]))
    terms = term_stats(_step_stats(records))
    entropy = torch.cat([p[0] for p in pieces]).mean()
    kl = torch.cat([p[1] for p in pieces]).mean()
    assert terms["entropy"] == pytest.approx(float(entropy), abs=1e-5)
    assert terms["kl_ref"] == pytest.approx(float(kl), abs=1e-5)
    assert terms["entropy"] > float(torch.cat([p[0] for p in pieces]).sum()) / 26 + 0.1  # not diluted
    idle = term_stats(_step_stats([records[1]]))
    assert "entropy" not in idle and "kl_ref" not in idle and TRAINED_SHARE not in idle
    assert term_stats({"mean_ratio": 1.0}) == {"mean_ratio": 1.0}  # no terms: the stats as they came


def test_config_refuses_bad_terms():
    with pytest.raises(ValueError, match="algorithm.entropy_coef"):
        AlgorithmConfig(entropy_coef=-0.1)
    with pytest.raises(ValueError, match="algorithm.kl_coef"):
        AlgorithmConfig(kl_coef=float("nan"))
    with pytest.raises(ValueError, match="algorithm.kl_estimator"):
        AlgorithmConfig(kl_estimator="low_var_kl")


@pytest.mark.parametrize("minibatches,epochs", [(1, 1), (3, 2)])
def test_reference_rows_attach_once_per_sample_and_mask_stand_ins(minibatches, epochs):
    algorithm = AlgorithmConfig(variant="decoupled", groups_per_step=1, kl_coef=0.1,
                                ppo_minibatches=minibatches, ppo_epochs=epochs)
    planner, ref = ShardPlanner(algorithm, ReplayConfig(k=2)), ReferenceRows(algorithm)
    calls = []

    def logprobs(batch, version):
        calls.append(version)
        return fake_logprobs(batch, version)

    plan = ref.attach(planner.step([make_group(1, 0, rewards=(1.0, 0.0))], 0, 0, logprobs), planner, logprobs)
    assert plan.stats.ref_rows == 2 and calls.count(REFERENCE_VERSION) == 2  # the step's pass and the ref pass
    assert len(plan.minibatches) == minibatches * epochs
    want = torch.cat([true_logp(s.sample_id, REFERENCE_VERSION, s.num_tokens) for s in plan.samples])
    parts = plan.minibatches[:minibatches]
    got = torch.cat([p.loss_inputs.logp_ref for p in parts])
    masks = torch.cat([p.loss_inputs.token_mask for p in parts])
    assert torch.equal(got[masks > 0], want) and int(masks.sum()) == want.numel()
    assert int((masks == 0).sum()) == max(minibatches - 2, 0)  # one-token stand-ins of empty parts
    assert all(isinstance(p.loss_inputs, RegularizedLossInputs) for p in plan.minibatches)
    planner.evict(1, plan.stats)
    # the group is selected again at version 1 (replay): its reference rows are reused, not recomputed
    calls.clear()
    plan = ref.attach(planner.step([make_group(2, 1, rewards=(0.0, 1.0))], 1, 1, logprobs), planner, logprobs)
    assert calls.count(REFERENCE_VERSION) == 1 and plan.stats.ref_rows == 2  # only the new group's


def test_the_reference_snapshot_is_taken_at_version_0_and_refused_when_a_resume_lacks_it():
    from types import SimpleNamespace

    from megatron_darl.step.regularize import ensure_reference, keep_versions
    from megatron_darl.trainer.snapshots import ParamSnapshots

    param = torch.arange(3.0)
    trainer = SimpleNamespace(snapshots=ParamSnapshots([param], pin=False), version=0)
    ensure_reference(trainer, only=True)
    assert trainer.snapshots.versions == [0]
    with torch.no_grad():
        param += 1  # trained on: the reference keeps the initial weights
    trainer.version = 3
    trainer.snapshots.take(3)  # what a resume loads besides the checkpoint's snapshots
    ensure_reference(trainer, only=True)  # a variant without backfill snapshots keeps v0 alone
    assert trainer.snapshots.versions == [0]
    with trainer.snapshots.swapped_in(0):
        assert torch.equal(param, torch.arange(3.0))
    assert keep_versions([2, 3], AlgorithmConfig(kl_coef=0.1)) == [2, 3, 0]
    assert keep_versions([2, 3], AlgorithmConfig()) == [2, 3]
    resumed = SimpleNamespace(snapshots=ParamSnapshots([param], pin=False), version=3)
    with pytest.raises(ValueError, match="algorithm.kl_coef > 0 needs the initial policy"):
        ensure_reference(resumed, only=False)
