"""ShardPlanner.step: versions, window, quota, histograms, backfill and the packed token layout.

Real ``SampleGroup``s, the real buffer, cache and algorithms; the trainer is replaced by a
deterministic function ``f(sample, version)`` of per-token log-probs, returned in the packed
layout exactly as ``trainer.compute_logprobs`` returns it (each sequence's response tokens in turn).
"""

import threading

import pytest
import torch

from megatron_darl.algorithms import Variant, batch_behavior_weights
from megatron_darl.step.config import AlgorithmConfig, MisConfig, ReplayConfig
from megatron_darl.loop.metrics import step_metrics
from megatron_darl.step.planner import ShardPlanner
from megatron_darl.step.sequences import sequence_batch
from megatron_darl.step.runner import loss_fn_for
from megatron_darl.replay import RowSource
from megatron_darl.samples import Sample, SampleGroup, shard_of
from megatron_darl.trainer.batch import TrainBatch

VOCAB = 50
SAMPLES: dict[tuple, Sample] = {}  # prompt ++ response token ids -> sample (the fake trainer's lookup)


def true_logp(sample_id: int, version: int, length: int) -> torch.Tensor:
    """Deterministic per-token log pi_version of a sample's response (the fake trainer)."""
    g = torch.Generator().manual_seed(sample_id)
    base = -torch.rand(length, generator=g) * 3 - 0.1
    drift = torch.randn(length, generator=g) * 0.05
    return base + drift * version


def make_group(group_id, version, rewards=(1.0, 0.0, 0.0, 1.0), prompt_len=3, seed=0):
    g = torch.Generator().manual_seed(group_id * 31 + seed)
    samples = []
    for i, r in enumerate(rewards):
        sid = group_id * 16 + i
        length = int(torch.randint(1, 7, (1,), generator=g))
        s = Sample(sample_id=sid, prompt_ids=torch.randint(0, VOCAB, (prompt_len,), generator=g),
                   response_ids=torch.randint(0, VOCAB, (length,), generator=g),
                   behavior_logprobs=true_logp(sid, version, length),
                   token_versions=torch.full((length,), version), reward=r)
        SAMPLES[tuple(torch.cat([s.prompt_ids, s.response_ids]).tolist())] = s
        samples.append(s)
    return SampleGroup(group_id=group_id, prompt_id=group_id, samples=samples, worker_id=0)


def fake_logprobs(batch: TrainBatch, version: int) -> torch.Tensor:
    """What ``trainer.compute_logprobs(batch, version)`` returns: (n,) in the packed layout."""
    out = []
    lens = batch.seq_lens.tolist()
    for ids, mask in zip(torch.split(batch.input_ids, lens), torch.split(batch.loss_mask, lens)):
        s = SAMPLES[tuple(ids.tolist())]
        assert int(mask.sum()) == s.num_tokens and bool(mask[-s.num_tokens:].all())
        out.append(true_logp(s.sample_id, version, s.num_tokens))
    logp = torch.cat(out)
    assert logp.shape == (batch.num_loss_tokens,)
    return logp


def algo(variant, **kw):
    return AlgorithmConfig(variant=variant, groups_per_step=kw.pop("b", 2), **kw)


def packed(rows):
    return torch.cat([r.float() for r in rows])


def test_arrival_caches_engine_rows_and_histogram():
    p = ShardPlanner(algo("darl", max_staleness=2), ReplayConfig(k=4))
    plan = p.step([make_group(1, 5), make_group(2, 3), make_group(3, 1)], 6, 6, fake_logprobs)
    st = plan.stats
    assert st.groups_received == 3 and st.dropped_stale == 1  # version 1 < 6 - 4 + 1
    assert st.staleness_hist.tolist() == [0, 1, 0, 1]  # staleness 1 and 3
    s = p.buffer.entry(1).group.samples[0]
    assert p.cache.source(s.sample_id, 5) is RowSource.ENGINE
    assert torch.equal(p.cache.get(s.sample_id, 5), s.behavior_logprobs)
    assert 3 not in p.buffer


def test_a_group_of_another_shard_is_refused():
    p = ShardPlanner(algo("darl"), ReplayConfig(), shard=0, num_shards=2, num_workers=2)
    gid = 1  # worker 1's first group: its deal starts at shard 1
    assert shard_of(gid, 2, 2) == 1
    with pytest.raises(ValueError, match="belongs to shard 1"):
        p.step([make_group(gid, 0)], 0, 0, fake_logprobs)


def test_pass_rows_are_cached_and_the_mismatch_measured():
    groups = [make_group(1, 0), make_group(2, 0)]
    p = ShardPlanner(algo("darl"), ReplayConfig())
    st = p.step(groups, 0, 0, fake_logprobs).stats
    tokens = sum(g.num_tokens for g in groups)
    assert st.mismatch_tokens == tokens and st.mismatch_k3_sum == pytest.approx(0.0, abs=1e-9)
    for s in (s for g in groups for s in g.samples):  # the engine row wins over the trainer's
        assert p.cache.source(s.sample_id, 0) is RowSource.ENGINE
    off = ShardPlanner(algo("darl"), ReplayConfig())
    assert off.step(groups, 0, 0, lambda b, v: fake_logprobs(b, v) * 1.1).stats.mismatch_k3_sum > 0


@pytest.mark.parametrize("variant", [v.value for v in Variant])
def test_variants_window_quota_and_loss_inputs(variant):
    spec_k = {"sync": 1, "async": 3, "decoupled": 3}.get(variant, 4)
    eta = 0 if variant == "sync" else 2
    max_rep = 1 if variant in ("sync", "async", "decoupled") else None
    p = ShardPlanner(algo(variant, b=2, max_staleness=eta), ReplayConfig(k=spec_k, max_replays=max_rep))
    gid, times = 0, {}
    for step in range(6):
        version, groups = step, []
        for _ in range(2):
            gid += 1
            groups.append(make_group(gid, max(0, version - (gid % (eta + 1))), seed=step))
        plan = p.step(groups, step, version, fake_logprobs, exact_versions=range(version))
        sel = plan.selection
        assert len(sel.entries) <= 2
        for e in sel.entries:
            assert p.window.holds(e.behavior_version, version)
            times[e.group_id] = times.get(e.group_id, 0) + 1
            assert max_rep is None or times[e.group_id] <= max_rep
        assert sum(plan.stats.selected_hist.tolist()) == len(sel.entries)
        assert plan.stats.times_selected_max == max((times[e.group_id] for e in sel.entries), default=0)
        x = plan.loss_inputs
        assert torch.isfinite(x.weights).all() and torch.isfinite(x.logp_base).all()
        assert (x.weights >= 0).all() and (x.weights <= 2.0 + 1e-6).all()
        if not plan.filler:  # aligned token by token with the selected samples' responses
            assert torch.allclose(x.logp_base, packed(
                s.behavior_logprobs if variant == "async" else true_logp(s.sample_id, version, s.num_tokens)
                for s in sel.samples))
            assert torch.equal(x.advantages, torch.cat([
                e.advantages.repeat_interleave(torch.tensor([s.num_tokens for s in e.group.samples]))
                for e in sel.entries]))
        p.evict(version + 1, plan.stats)
        assert all(p.window.holds(e.behavior_version, version + 1) for e in p.buffer.entries())
        assert set(p.cache.state_dict()["sample_ids"]) <= set(p.buffer.sample_ids())  # rows left with their sample


def _padded(rows, t_max):
    return torch.stack([torch.nn.functional.pad(r, (0, t_max - r.shape[0])) for r in rows])


def test_mixture_weights_match_the_padded_computation_after_backfill():
    p = ShardPlanner(algo("darl", b=3), ReplayConfig(k=4))
    plan = p.step([make_group(1, 1), make_group(2, 2), make_group(3, 3)], 3, 3, fake_logprobs,
                  exact_versions=[0, 1, 2])
    sel = plan.selection
    assert {e.behavior_version for e in sel.entries} == {1, 2, 3}
    assert p.cache.missing([s.sample_id for s in sel.samples], [1, 2, 3], trainer=True) == []
    assert plan.stats.backfill_own == sum(1 for s in sel.samples if s.behavior_version < 3)  # snapshots
    samples = sel.samples
    t_max = max(s.num_tokens for s in samples)
    mask = torch.arange(t_max)[None] < torch.tensor([s.num_tokens for s in samples])[:, None]
    by_v = torch.stack([_padded([s.behavior_logprobs if s.behavior_version == v else
                                 true_logp(s.sample_id, v, s.num_tokens) for s in samples], t_max)
                        for v in [0, 1, 2, 3]])
    expect = batch_behavior_weights(
        "darl", _padded([true_logp(s.sample_id, 3, s.num_tokens) for s in samples], t_max),
        by_v, torch.tensor([0, 1, 2, 3]), torch.tensor([s.behavior_version for s in samples]), mask)
    assert torch.allclose(plan.loss_inputs.weights, expect.weights[mask])  # packed == padded[mask]
    assert plan.stats.w_tokens == mask.sum() and plan.stats.backfill_snapshot > 0
    for s in samples:
        assert p.cache.source(s.sample_id, s.behavior_version) is RowSource.ENGINE


def test_only_the_prefix_posterior_costs_own_version_rows():
    """The token form and the own-behavior weight read no trainer row of a sample's own version:
    no backfill computes one (the prefix form's cost, above, is one row per late sample)."""
    for variant, form in (("darl", "token"), ("darl_nomis", "prefix")):
        p = ShardPlanner(algo(variant, b=3, mis=MisConfig(form=form)), ReplayConfig(k=4))
        plan = p.step([make_group(1, 1), make_group(2, 2), make_group(3, 3)], 3, 3, fake_logprobs,
                      exact_versions=[0, 1, 2])
        assert plan.stats.backfill_own == 0
        assert all(not p.cache.has(s.sample_id, s.behavior_version, trainer=True)
                   for s in plan.selection.samples if s.behavior_version < 3)


def interrupted_group(group_id, first, then):
    """A group generated across a publish (``interrupt`` mode): each response's first tokens come
    from version ``first`` and the rest from ``then``; the engine reports each token's log-prob
    under the version that sampled it (its per-token behavior density)."""
    group = make_group(group_id, first)
    for s in group.samples:
        n = s.num_tokens
        switch = n // 2 if n > 1 else n  # a one-token response stays on ``first``
        s.token_versions[switch:] = then
        s.behavior_logprobs = torch.cat([true_logp(s.sample_id, first, n)[:switch],
                                         true_logp(s.sample_id, then, n)[switch:]])
    return group


@pytest.mark.parametrize("variant", ["darl", "decoupled"])
def test_interrupted_samples_carry_their_per_token_behavior_density(variant):
    """A response whose tokens span versions v..t is filed under v_i = min(token_versions) with
    the engine's per-token row (the density it was really drawn from), never used for the
    mismatch metric, and weighted token by token: the own-behavior weight of a token sampled by
    pi_t is exactly 1, and the mixture uses the engine row for the k = v_i term."""
    t = 3
    mixed, clean = interrupted_group(1, 2, t), make_group(2, t)
    p = ShardPlanner(algo(variant, b=2), ReplayConfig(k=3 if variant == "decoupled" else 4))
    plan = p.step([mixed, clean], t, t, fake_logprobs, exact_versions=[0, 1, 2])
    spanning = [s for s in mixed.samples if int(s.token_versions.max()) != int(s.token_versions.min())]
    assert spanning and mixed.behavior_version == 2
    assert plan.stats.mixed_version_samples == len(spanning)
    assert plan.stats.mismatch_tokens == clean.num_tokens  # only samples wholly of version t
    for s in mixed.samples:
        assert p.cache.source(s.sample_id, 2) is RowSource.ENGINE
        assert torch.equal(p.cache.get(s.sample_id, 2), s.behavior_logprobs)
    sel = plan.selection.samples
    assert {s.sample_id for s in sel} == {s.sample_id for g in (mixed, clean) for s in g.samples}
    t_max = max(s.num_tokens for s in sel)
    mask = torch.arange(t_max)[None] < torch.tensor([s.num_tokens for s in sel])[:, None]
    weights = torch.zeros(mask.shape)
    weights[mask] = plan.loss_inputs.weights.float()
    if variant == "decoupled":  # w = pi_t / mu per token: 1 wherever pi_t sampled the token
        for i, s in enumerate(sel):
            at_t = s.token_versions == t
            assert torch.allclose(weights[i, : s.num_tokens][at_t], torch.ones(int(at_t.sum())), atol=1e-6)
            if (~at_t).any():  # tokens of version 2: pi_3 / pi_2, not 1
                assert not torch.allclose(weights[i, : s.num_tokens][~at_t], torch.ones(int((~at_t).sum())))
    else:
        by_v = torch.stack([_padded([s.behavior_logprobs if s.behavior_version == v else
                                     true_logp(s.sample_id, v, s.num_tokens) for s in sel], t_max)
                            for v in [2, 3]])
        expect = batch_behavior_weights(
            "darl", _padded([true_logp(s.sample_id, t, s.num_tokens) for s in sel], t_max),
            by_v, torch.tensor([2, 3]), torch.tensor([s.behavior_version for s in sel]), mask)
        assert torch.allclose(weights[mask], expect.weights[mask].float(), atol=1e-6)


def per_sample_batch(rows, loss_inputs=None) -> TrainBatch:
    """A batch as the step built it before groups were packed on arrival: each sample re-packed
    from its ``(prompt_ids, response_ids)``, scored on the response."""
    tokens = [torch.cat([p, r]) for p, r in rows]
    masks = [torch.arange(len(p) + len(r)) >= len(p) for p, r in rows]
    return TrainBatch.from_sequences(tokens, masks, loss_inputs)


def assert_same_batch(got: TrainBatch, want: TrainBatch):
    for name in ("input_ids", "seq_lens", "loss_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.loss_inputs is None) == (want.loss_inputs is None)
    for name in ("logp_base", "weights", "advantages") if want.loss_inputs is not None else ():
        assert torch.equal(getattr(got.loss_inputs, name), getattr(want.loss_inputs, name)), name


def test_every_batch_of_a_step_is_its_samples_packed_one_by_one():
    """Groups are packed once, on arrival; the log-prob pass, each backfill pass (one missing the
    row of a single sample of a group included) and the mini-batches are cut from those pieces
    and must equal the per-sample packing of their samples, taken from copies made before arrival."""
    mixed = make_group(1, 2)
    odd = mixed.samples[1]  # wholly of version 3: its group lacks a version-2 row for it alone
    odd.token_versions[:] = 3
    odd.behavior_logprobs = true_logp(odd.sample_id, 3, odd.num_tokens)
    steps = [(3, [mixed, make_group(2, 1), make_group(3, 3)]), (4, [make_group(4, 3), make_group(5, 4)])]
    rows = {s.sample_id: (s.prompt_ids.clone(), s.response_ids.clone())
            for _, groups in steps for g in groups for s in g.samples}
    seen = []

    def recording(batch, version):
        seen.append((batch, version))
        return fake_logprobs(batch, version)

    # the token form: the prefix form's posterior needs every sample's own-version trainer row too,
    # so no backfill pass would miss the row of one sample of a group alone
    p = ShardPlanner(algo("darl", b=3, ppo_minibatches=3, mis=MisConfig(form="token")), ReplayConfig(k=4))
    for t, groups in steps:
        plan = p.step(groups, t, t, recording, exact_versions=range(t))
        n = len(plan.samples)
        for idx, part in zip(torch.arange(n).tensor_split(3), plan.minibatches):
            ends = torch.cumsum(torch.tensor([s.num_tokens for s in plan.samples]), 0).tolist()
            first, last = int(idx[0]), int(idx[-1])
            start, end = ends[first - 1] if first else 0, ends[last]
            x = plan.loss_inputs
            want = per_sample_batch([rows[s.sample_id] for s in plan.samples[first:last + 1]],
                                    type(x)(x.logp_base[start:end], x.weights[start:end], x.advantages[start:end]))
            assert_same_batch(part, want)
        p.evict(t + 1, plan.stats)
    assert any(v < t for _, v in seen) and plan.stats.backfill_snapshot > 0
    partial = False
    for batch, version in seen:
        ids = [SAMPLES[tuple(x.tolist())].sample_id for x in torch.split(batch.input_ids, batch.seq_lens.tolist())]
        assert_same_batch(batch, per_sample_batch([rows[i] for i in ids]))
        partial |= odd.sample_id in ids and mixed.samples[0].sample_id not in ids
    assert partial  # a group cut to the one sample that lacked the row


def test_nearest_backfill_fills_every_needed_row():
    p = ShardPlanner(algo("darl", b=2, mis=MisConfig(backfill="nearest")), ReplayConfig(k=4))
    plan = p.step([make_group(1, 1), make_group(2, 3)], 3, 3, fake_logprobs)  # no exact versions
    old, new = p.buffer.entry(1).group.samples, p.buffer.entry(2).group.samples
    # v1 rows of group 2, and group 1's own v1 rows for the posterior: copies of their v3 rows
    assert plan.stats.backfill_nearest == len(new) + len(old) and plan.stats.backfill_own == len(old)
    assert plan.stats.backfill_snapshot == 0
    for s in old:
        assert p.cache.source(s.sample_id, 1, trainer=True) is RowSource.NEAREST
        assert torch.equal(p.cache.get(s.sample_id, 1, trainer=True), p.cache.get(s.sample_id, 3))
        assert torch.equal(p.cache.get(s.sample_id, 1), s.behavior_logprobs)  # the engine's for the term
    assert p.cache.missing([s.sample_id for s in plan.selection.samples], [1, 3], trainer=True) == []
    assert torch.isfinite(plan.loss_inputs.weights).all()


class ThreadSum:
    """``dp_sum`` over planners stepping in threads of one process: a two-party all-reduce."""

    def __init__(self, parties: int) -> None:
        self.barrier, self.parts = threading.Barrier(parties), []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.parts.append(t.clone())
        self.barrier.wait(10)
        total = sum(self.parts)
        self.barrier.wait(10)
        return total


@pytest.mark.parametrize("b, shards, quotas", [(4, 2, [2, 2]), (5, 3, [2, 2, 1])])
def test_shards_take_their_quota_and_share_alpha(b, shards, quotas):
    """B split over the DP shards as evenly as it goes (5 on 3: 2, 2, 1), one alpha for all."""
    planners = [ShardPlanner(algo("darl", b=b), ReplayConfig(k=4), shard=i, num_shards=shards, num_workers=2)
                for i in range(shards)]
    assert [p.quota for p in planners] == quotas
    groups = [make_group(g, g % 3) for g in range(1, 31)]
    dp, plans = ThreadSum(shards), [None] * shards

    def run(i):
        mine = [g for g in groups if shard_of(g.group_id, shards, 2) == i]
        plans[i] = planners[i].step(mine, 2, 2, fake_logprobs, exact_versions=[0, 1], dp_sum=dp)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(shards)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert [len(pl.selection.entries) for pl in plans] == quotas
    total = sum(pl.selection.version_tokens for pl in plans)
    assert torch.equal(sum(dp.parts), total) and all(torch.isfinite(pl.loss_inputs.weights).all() for pl in plans)


def test_warmup_takes_freshest_and_a_filler_when_nothing_is_selectable():
    p = ShardPlanner(algo("darl", b=1), ReplayConfig(k=4, warmup=1))
    plan = p.step([make_group(1, 0), make_group(2, 1)], 0, 1, fake_logprobs, exact_versions=[0])
    assert [e.group_id for e in plan.selection.entries] == [2] and plan.selection.scores == [0.0]
    p.evict(2, plan.stats)
    calls = []
    plan = p.step([make_group(3, 2, rewards=(1.0, 1.0))], 1, 2, lambda b, v: calls.append(b) or fake_logprobs(b, v),
                  exact_versions=[0, 1])
    assert calls[0].num_sequences == 8  # degenerate group 3 is not even a candidate
    chosen = plan.selection.entries[0].group_id
    assert chosen == 2 and plan.stats.score_count == 2  # the fresher group drifted less from pi_t
    q = ShardPlanner(algo("darl", b=1), ReplayConfig(k=4))
    plan = q.step([make_group(5, 0, rewards=(0.0, 0.0))], 0, 0, fake_logprobs)
    assert plan.selection.entries == [] and plan.filler and len(plan.samples) == 1
    assert float(plan.loss_inputs.weights.abs().sum()) == 0.0
    empty = ShardPlanner(algo("darl", b=2), ReplayConfig(k=4), shard=0, num_shards=2)
    plan = empty.step([], 0, 0, fake_logprobs)  # step 0, every group hashed to the other shard
    assert plan.filler and plan.stats.w_tokens == 0.0 and len(plan.minibatches) == 1


def test_loss_fn_contract_sum_and_gradient():
    p = ShardPlanner(algo("decoupled", b=2), ReplayConfig(k=3))
    mb = p.step([make_group(1, 0), make_group(2, 0)], 0, 0, fake_logprobs).minibatches[0]
    x = mb.loss_inputs
    logp = x.logp_base.clone().requires_grad_(True)
    loss_sum, stats = loss_fn_for(0.2, 0.2)(logp, mb)
    assert loss_sum.dim() == 0 and set(stats) >= {"clip_frac_low", "clip_frac_high"}
    loss_sum.backward()
    assert torch.allclose(logp.grad, -x.weights * x.advantages, atol=1e-6)  # -w*rho*A at rho = 1


def test_empty_prompt_refused():
    g = make_group(1, 0, prompt_len=0)
    with pytest.raises(ValueError, match="empty prompt"):
        sequence_batch(g.samples)


def test_state_roundtrip_and_shard_check():
    p = ShardPlanner(algo("darl"), ReplayConfig())
    p.step([make_group(1, 0), make_group(2, 0)], 0, 0, fake_logprobs)
    q = ShardPlanner(algo("darl"), ReplayConfig())
    q.load_state_dict(p.state_dict())
    assert q.buffer.sample_ids() == p.buffer.sample_ids() and q.cache.bytes() == p.cache.bytes()
    r = ShardPlanner(algo("darl"), ReplayConfig(), shard=1, num_shards=2)
    with pytest.raises(ValueError, match="cannot load"):
        r.load_state_dict(p.state_dict())


@pytest.mark.parametrize("m, epochs", [(1, 1), (2, 1), (3, 2), (5, 1)])
def test_minibatches_are_contiguous_slices_of_the_step(m, epochs):
    p = ShardPlanner(algo("decoupled", b=2, ppo_minibatches=m, ppo_epochs=epochs), ReplayConfig(k=3))
    plan = p.step([make_group(1, 0), make_group(2, 0)], 0, 0, fake_logprobs)
    n = len(plan.samples)  # 8 samples
    assert len(plan.minibatches) == m * epochs
    parts = plan.minibatches[:m]
    assert [b.num_sequences for b in parts] == [len(i) for i in torch.arange(n).tensor_split(m)]
    for name in ("weights", "logp_base", "advantages"):  # the same per-token values, in order
        assert torch.equal(torch.cat([getattr(b.loss_inputs, name) for b in parts]),
                           getattr(plan.loss_inputs, name))
    for e in range(1, epochs):  # later epochs repeat the same mini-batches
        assert all(a is b for a, b in zip(plan.minibatches[e * m:(e + 1) * m], parts))


def test_the_groups_of_a_step_reach_the_minibatches_in_a_seeded_order():
    """With M > 1, selection order (freshest or lowest score first: the stalest groups last) is
    not the training order: the step's groups are shuffled, the same way in a rerun (and per step)."""
    def planned(seed, step=0):
        p = ShardPlanner(algo("decoupled", b=8, ppo_minibatches=4, seed=seed), ReplayConfig(k=3))
        groups = [make_group(g, 0) for g in range(1, 9)]
        plan = p.step(groups, step, 0, fake_logprobs)
        return [e.group_id for e in plan.selection.entries], plan

    fifo = sorted(range(1, 9), reverse=True)  # freshest first: the latest arrival
    first, plan = planned(seed=0)
    assert sorted(first) == list(range(1, 9)) and first != fifo
    assert planned(seed=0)[0] == first  # a rerun trains in the same order
    assert planned(seed=1)[0] != first and planned(seed=0, step=1)[0] != first
    samples = [s.sample_id for e in plan.selection.entries for s in e.group.samples]
    assert [s.sample_id for s in plan.samples] == samples  # the mini-batches follow the shuffled groups
    one = ShardPlanner(algo("decoupled", b=8, ppo_minibatches=1), ReplayConfig(k=3))
    assert [e.group_id for e in one.step([make_group(g, 0) for g in range(1, 9)], 0, 0,
                                        fake_logprobs).selection.entries] == fifo  # M = 1: as selected


def test_minibatches_more_than_samples_and_empty_shard_get_zero_weight_fillers():
    p = ShardPlanner(algo("sync", b=1, max_staleness=0, ppo_minibatches=4), ReplayConfig(k=1))
    plan = p.step([make_group(1, 0, rewards=(1.0, 0.0))], 0, 0, fake_logprobs)
    assert len(plan.samples) == 2 and len(plan.minibatches) == 4
    assert [b.num_sequences for b in plan.minibatches] == [1, 1, 1, 1]
    for filler in plan.minibatches[2:]:
        assert float(filler.loss_inputs.weights.abs().sum()) == 0.0
        assert float(filler.loss_inputs.advantages.abs().sum()) == 0.0
    empty = ShardPlanner(algo("darl", b=2, ppo_minibatches=3), ReplayConfig(k=4), shard=0, num_shards=2)
    plan = empty.step([], 0, 0, fake_logprobs)
    assert plan.filler and len(plan.minibatches) == 3
    assert all(float(b.loss_inputs.weights.abs().sum()) == 0.0 for b in plan.minibatches)


def test_naive_async_needs_no_logprob_pass():
    def no_pass(batch, version):
        raise AssertionError("naive async must not run a log-prob pass")

    p = ShardPlanner(algo("async", b=2), ReplayConfig(k=3, max_replays=1))
    plan = p.step([make_group(1, 0), make_group(2, 1)], 1, 1, no_pass)
    sel = plan.selection
    assert [e.group_id for e in sel.entries] == [2, 1]  # fifo: freshest first
    assert torch.equal(plan.loss_inputs.logp_base, packed(s.behavior_logprobs for s in sel.samples))
    assert torch.equal(plan.loss_inputs.weights, torch.ones(int(plan.stats.w_tokens)))
    tis = ShardPlanner(algo("async", b=2, rollout_is=2.0), ReplayConfig(k=3, max_replays=1))
    with pytest.raises(AssertionError, match="log-prob pass"):  # rollout IS reads pi_t: a pass
        tis.step([make_group(1, 0)], 1, 1, no_pass)


def test_oldest_selected_and_cache_rows_by_source():
    p = ShardPlanner(algo("darl", b=3), ReplayConfig(k=4))
    plan = p.step([make_group(1, 1), make_group(2, 2), make_group(3, 3)], 3, 3, fake_logprobs,
                  exact_versions=[0, 1, 2])
    assert plan.stats.selected_staleness_max == 2.0  # version 1 at t = 3
    q = ShardPlanner(algo("darl"), ReplayConfig())
    assert q.step([], 3, 3, fake_logprobs).stats.selected_staleness_max == -1.0  # none
    p.evict(4, plan.stats)
    st, n, fresh = plan.stats, len(plan.samples), len(p.buffer.entry(3).group.samples)
    assert st.cache_rows_engine == n and st.cache_rows_snapshot > 0
    # the pass at t = 3 adds a trainer row to every sample, beside the engine row of version 3
    assert st.cache_rows_trainer == n and st.cache_rows_nearest == 0
    assert all(p.cache.source(s.sample_id, 3, trainer=True) is RowSource.TRAINER
               for s in p.buffer.entry(3).group.samples) and fresh > 0
    assert st.cache_rows_engine + st.cache_rows_trainer + st.cache_rows_snapshot == len(p.cache)


def test_capped_weights_counted_in_both_cap_modes():
    for mode in ("clip", "mask"):
        p = ShardPlanner(algo("decoupled", b=2, mis=MisConfig(clip=1.01, cap_mode=mode)), ReplayConfig(k=3))
        plan = p.step([make_group(1, 0), make_group(2, 0)], 2, 2, fake_logprobs)
        w = plan.loss_inputs.weights
        over = int((w >= 1.01).sum()) if mode == "clip" else int((w == 0).sum())
        assert plan.stats.w_clipped == over > 0, mode
        # the split by advantage sign covers the same tokens and weights
        adv, st = plan.loss_inputs.advantages, plan.stats
        assert st.w_pos_tokens == int((adv > 0).sum()) and st.w_neg_tokens == int((adv < 0).sum())
        assert st.w_pos_clipped + st.w_neg_clipped <= st.w_clipped
        assert st.w_pos_sum == pytest.approx(float(w[adv > 0].sum()))
        assert st.w_neg_sum == pytest.approx(float(w[adv < 0].sum()))
        if mode == "clip":
            assert st.w_pos_clipped == int((w[adv > 0] >= 1.01).sum())
        m = step_metrics(st)
        assert m["weight_mean_pos"] == pytest.approx(st.w_pos_sum / st.w_pos_tokens)
