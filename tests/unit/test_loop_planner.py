"""ShardPlanner: versions, window, quota, histograms, backfill and token alignment of the fields.

Real ``SampleGroup``s, the real buffer, cache and algorithms; the trainer is replaced by a
deterministic function ``f(sample, version)`` of per-token log-probs, laid onto the packed batch
exactly where the trainer would put them (position P + j for response token j).
"""

import pytest
import torch

from megatron_darl.algorithms import Variant, batch_behavior_weights
from megatron_darl.loop.config import AlgorithmConfig, MisConfig, ReplayConfig
from megatron_darl.loop.planner import ShardPlanner, loss_fn_for
from megatron_darl.loop.sequences import sequence_batch
from megatron_darl.replay import RowSource, shard_of
from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.trainer.batch import TrainBatch

VOCAB = 50


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
        samples.append(Sample(
            sample_id=sid, prompt_ids=torch.randint(0, VOCAB, (prompt_len,), generator=g),
            response_ids=torch.randint(0, VOCAB, (length,), generator=g),
            behavior_logprobs=true_logp(sid, version, length),
            token_versions=torch.full((length,), version), reward=r,
        ))
    return SampleGroup(group_id=group_id, prompt_id=group_id, samples=samples, worker_id=0)


def fake_pass(batch: TrainBatch, samples, version: int) -> torch.Tensor:
    """What ``trainer.compute_logprobs(batch)`` returns: (T,) with log pi at scored positions."""
    out = torch.zeros(batch.num_tokens)
    for off, s in zip(batch.offsets.tolist(), samples):
        p = s.prompt_ids.shape[0]
        out[off + p: off + p + s.num_tokens] = true_logp(s.sample_id, version, s.num_tokens)
    assert torch.equal(out != 0, batch.loss_mask)
    return out


def algo(variant, **kw):
    return AlgorithmConfig(variant=variant, groups_per_step=kw.pop("b", 2), **kw)


def run_step(planner, groups, step, version, allreduce=lambda t: t):
    planner.receive(groups, step, version)
    cand, scores = planner.candidate_batch(), {}
    if cand is not None:
        planner.store_logprobs(cand, fake_pass(cand.batch, cand.samples, version), version)
        scores = planner.score(cand, step)
    sel = planner.select(step, scores, version)
    tokens = allreduce(sel.version_tokens.clone())
    for v in planner.mixture_versions(sel, tokens):
        todo = planner.backfill_batch(sel, v)
        if todo is not None:
            batch, samples = todo
            planner.store_backfill(batch, samples, fake_pass(batch, samples, v), v)
    tb = planner.training_batch(sel, tokens, version)
    return cand, scores, sel, tb


def test_receive_caches_engine_rows_and_histogram():
    p = ShardPlanner(algo("darl", max_staleness=2), ReplayConfig(k=4))
    sums = p.receive([make_group(1, 5), make_group(2, 3), make_group(3, 1)], step=6, version=6)
    assert sums["groups_received"] == 3 and sums["dropped_stale"] == 1  # version 1 < 6 - 4 + 1
    assert sums["staleness_hist"].tolist() == [0, 1, 0, 1]  # staleness 1 and 3
    s = p.buffer.entry(1).group.samples[0]
    assert p.cache.source(s.sample_id, 5) is RowSource.ENGINE
    assert torch.equal(p.cache.get(s.sample_id, 5), s.behavior_logprobs)
    assert 3 not in p.buffer


def test_receive_refuses_other_shard():
    p = ShardPlanner(algo("darl"), ReplayConfig(), shard=0, num_shards=2)
    gid = next(i for i in range(100) if shard_of(i, 2) == 1)
    with pytest.raises(ValueError, match="belongs to shard 1"):
        p.receive([make_group(gid, 0)], 0, 0)


def test_pass_rows_align_with_response_tokens_and_mismatch():
    p = ShardPlanner(algo("darl"), ReplayConfig())
    p.receive([make_group(1, 0), make_group(2, 0)], 0, 0)
    cand = p.candidate_batch()
    assert cand.batch.num_loss_tokens == sum(s.num_tokens for s in cand.samples)
    mism = p.store_logprobs(cand, fake_pass(cand.batch, cand.samples, 0), 0)
    assert mism["mismatch_tokens"] == cand.batch.num_loss_tokens
    assert mism["mismatch_k3_sum"] == pytest.approx(0.0, abs=1e-9)  # trainer == engine
    for s in cand.samples:  # the engine row wins over the trainer row of the same version
        assert p.cache.source(s.sample_id, 0) is RowSource.ENGINE
    p.evict(0)
    p.store_logprobs(cand, fake_pass(cand.batch, cand.samples, 0) * 1.1, 0)
    assert p.store_logprobs(cand, fake_pass(cand.batch, cand.samples, 0) * 1.1, 0)[
        "mismatch_k3_sum"] > 0


@pytest.mark.parametrize("variant", [v.value for v in Variant])
def test_variants_window_quota_and_fields(variant):
    spec_k = {"sync": 1, "async": 3, "decoupled": 3}.get(variant, 4)
    eta = 0 if variant == "sync" else 2
    max_rep = 1 if variant in ("sync", "async", "decoupled") else None
    p = ShardPlanner(algo(variant, b=2, max_staleness=eta), ReplayConfig(k=spec_k, max_replays=max_rep))
    gid, times = 0, {}
    for step in range(6):
        version = step
        groups = []
        for _ in range(2):
            gid += 1
            groups.append(make_group(gid, max(0, version - (gid % (eta + 1))), seed=step))
        cand, scores, sel, tb = run_step(p, groups, step, version)
        assert len(sel.entries) <= 2
        for e in sel.entries:
            assert version - spec_k + 1 <= e.behavior_version <= version  # window
            times[e.group_id] = times.get(e.group_id, 0) + 1
            assert max_rep is None or times[e.group_id] <= max_rep
        sel_sums = p.selection_sums(sel, version)
        assert sum(sel_sums["selected_hist"].tolist()) == len(sel.entries)
        assert sel_sums["times_selected_max"] == max((times[e.group_id] for e in sel.entries), default=0)
        b = tb.batch
        w, base = b.masked("weights"), b.masked("logp_base")
        assert torch.isfinite(w).all() and torch.isfinite(base).all()
        assert (w >= 0).all() and (w <= 2.0 + 1e-6).all()
        if not tb.filler:
            expect_base = torch.cat([
                s.behavior_logprobs if variant == "async" else true_logp(s.sample_id, version, s.num_tokens)
                for s in sel.samples])
            assert torch.allclose(base, expect_base)  # aligned token by token
            adv = torch.cat([e.advantages.repeat_interleave(torch.tensor([s.num_tokens for s in e.group.samples]))
                             for e in sel.entries])
            assert torch.equal(b.per_token("advantages"), adv)
        p.evict(version + 1)
        assert all(e.behavior_version >= version + 1 - spec_k + 1 for e in p.buffer.entries())
        assert len(p.cache) == sum(len(p.cache.versions(s)) for s in p.buffer.sample_ids())


def test_mixture_weights_match_direct_computation_after_backfill():
    p = ShardPlanner(algo("darl", b=3), ReplayConfig(k=4))
    p.receive([make_group(1, 1), make_group(2, 2), make_group(3, 3)], step=3, version=3)
    cand, scores, sel, tb = run_step(p, [], 3, 3)
    assert {e.behavior_version for e in sel.entries} == {1, 2, 3}
    assert p.missing_rows(sel, [1, 2, 3]) == []
    samples = sel.samples
    t_max = max(s.num_tokens for s in samples)
    mask = torch.arange(t_max)[None] < torch.tensor([s.num_tokens for s in samples])[:, None]
    def pad(rows):
        return torch.stack([torch.nn.functional.pad(r, (0, t_max - r.shape[0])) for r in rows])
    by_v = torch.stack([pad([s.behavior_logprobs if s.behavior_version == v else
                             true_logp(s.sample_id, v, s.num_tokens) for s in samples])
                        for v in [0, 1, 2, 3]])
    expect = batch_behavior_weights(
        "darl", pad([true_logp(s.sample_id, 3, s.num_tokens) for s in samples]),
        by_v, torch.tensor([0, 1, 2, 3]), torch.tensor([s.behavior_version for s in samples]), mask)
    assert torch.allclose(tb.batch.masked("weights"), expect.weights[mask])
    assert tb.sums["w_tokens"] == mask.sum()
    for s in samples:  # version-1/2 rows of the fresher samples came from the snapshot pass
        assert p.cache.source(s.sample_id, s.behavior_version) is RowSource.ENGINE


def test_nearest_backfill_fills_every_needed_row():
    p = ShardPlanner(algo("darl", b=2, mis=MisConfig(backfill="nearest")), ReplayConfig(k=4))
    p.receive([make_group(1, 1), make_group(2, 3)], step=3, version=3)
    cand = p.candidate_batch()
    p.store_logprobs(cand, fake_pass(cand.batch, cand.samples, 3), 3)
    sel = p.select(3, p.score(cand, 3), 3)
    need = p.mixture_versions(sel, sel.version_tokens)
    assert need == [1, 3] and p.missing_rows(sel, need)
    assert p.backfill_nearest(sel, need) == len(p.buffer.entry(2).group.samples)
    assert p.missing_rows(sel, need) == []
    assert torch.isfinite(p.training_batch(sel, sel.version_tokens, 3).batch.masked("weights")).all()


def test_two_shards_quota_and_summed_alpha():
    b = 4
    planners = [ShardPlanner(algo("darl", b=b), ReplayConfig(k=4), shard=i, num_shards=2) for i in range(2)]
    groups = [make_group(g, g % 3) for g in range(1, 13)]
    for p in planners:
        p.receive([g for g in groups if shard_of(g.group_id, 2) == p.shard], 2, 2)
    sels, cands = [], []
    for p in planners:
        cand = p.candidate_batch()
        p.store_logprobs(cand, fake_pass(cand.batch, cand.samples, 2), 2)
        sels.append(p.select(2, p.score(cand, 2), 2))
    assert all(len(s.entries) == b // 2 for s in sels)
    total = sels[0].version_tokens + sels[1].version_tokens  # what allreduce_sum returns
    for p, sel in zip(planners, sels):
        for v in p.mixture_versions(sel, total):
            todo = p.backfill_batch(sel, v)
            if todo:
                p.store_backfill(todo[0], todo[1], fake_pass(todo[0], todo[1], v), v)
        tb = p.training_batch(sel, total, 2)
        assert torch.isfinite(tb.batch.masked("weights")).all()


def test_warmup_takes_freshest_and_filler_when_nothing_selectable():
    p = ShardPlanner(algo("darl", b=1), ReplayConfig(k=4, warmup=1))
    cand, scores, sel, tb = run_step(p, [make_group(1, 0), make_group(2, 1)], 0, 1)
    assert [e.group_id for e in sel.entries] == [2] and sel.scores == [0.0]
    p.evict(2)
    cand, scores, sel, tb = run_step(p, [make_group(3, 2, rewards=(1.0, 1.0))], 1, 2)
    assert set(scores) == {1, 2}  # degenerate group 3 is not even a candidate
    assert [e.group_id for e in sel.entries] == [min(scores, key=scores.get)]  # lowest chi2
    assert scores[2] < scores[1]  # the fresher group drifted less from pi_t
    q = ShardPlanner(algo("darl", b=1), ReplayConfig(k=4))
    _, _, sel, tb = run_step(q, [make_group(5, 0, rewards=(0.0, 0.0))], 0, 0)
    assert sel.entries == [] and tb.filler
    assert tb.batch.num_sequences == 1 and float(tb.batch.masked("weights").abs().sum()) == 0.0
    empty = ShardPlanner(algo("darl", b=2), ReplayConfig(k=4), shard=0, num_shards=2)
    _, _, sel, tb = run_step(empty, [], 0, 0)  # step 0, every group hashed to the other shard
    assert sel.entries == [] and tb.filler and tb.batch.num_sequences == 1
    assert float(tb.batch.masked("weights").abs().sum()) == 0.0 and tb.sums["w_tokens"] == 0.0


def test_loss_fn_contract_sum_and_gradient():
    p = ShardPlanner(algo("decoupled", b=2), ReplayConfig(k=3))
    _, _, sel, tb = run_step(p, [make_group(1, 0), make_group(2, 0)], 0, 0)
    logp = tb.batch.masked("logp_base").clone().requires_grad_(True)
    loss_sum, stats = loss_fn_for(0.2, 0.2)(logp, tb.batch)
    assert loss_sum.dim() == 0 and set(stats) >= {"clip_frac_low", "clip_frac_high"}
    loss_sum.backward()
    w, adv = tb.batch.masked("weights"), tb.batch.per_token("advantages")
    assert torch.allclose(logp.grad, -w * adv, atol=1e-6)  # d/dlogp of -w*rho*A at rho = 1


def test_empty_prompt_refused():
    g = make_group(1, 0, prompt_len=0)
    with pytest.raises(ValueError, match="empty prompt"):
        sequence_batch(g.samples)


def test_state_roundtrip_and_shard_check():
    p = ShardPlanner(algo("darl"), ReplayConfig())
    run_step(p, [make_group(1, 0), make_group(2, 0)], 0, 0)
    q = ShardPlanner(algo("darl"), ReplayConfig())
    q.load_state_dict(p.state_dict())
    assert q.buffer.sample_ids() == p.buffer.sample_ids() and q.cache.bytes() == p.cache.bytes()
    r = ShardPlanner(algo("darl"), ReplayConfig(), shard=1, num_shards=2)
    with pytest.raises(ValueError, match="cannot load"):
        r.load_state_dict(p.state_dict())


@pytest.mark.parametrize("m, epochs", [(1, 1), (2, 1), (3, 2), (5, 1)])
def test_minibatches_partition_the_selection(m, epochs):
    p = ShardPlanner(algo("decoupled", b=2, ppo_minibatches=m, ppo_epochs=epochs), ReplayConfig(k=3))
    _, _, sel, tb = run_step(p, [make_group(1, 0), make_group(2, 0)], 0, 0)
    n = len(sel.samples)  # 8 samples
    assert len(tb.minibatches) == m * epochs
    parts = tb.minibatches[:m]
    sizes = [b.num_sequences for b in parts]
    assert sizes == [len(i) for i in torch.arange(n).tensor_split(m)]  # contiguous, +-1
    for name in ("weights", "logp_base"):  # the same per-token values as the whole batch, in order
        assert torch.equal(torch.cat([b.masked(name) for b in parts]), tb.batch.masked(name))
    assert torch.equal(torch.cat([b.per_token("advantages") for b in parts]),
                       tb.batch.per_token("advantages"))
    for e in range(1, epochs):  # later epochs repeat the same mini-batches
        assert all(a is b for a, b in zip(tb.minibatches[e * m:(e + 1) * m], parts))


def test_minibatches_more_than_samples_and_empty_shard_get_zero_weight_fillers():
    p = ShardPlanner(algo("sync", b=1, max_staleness=0, ppo_minibatches=4), ReplayConfig(k=1))
    _, _, sel, tb = run_step(p, [make_group(1, 0, rewards=(1.0, 0.0))], 0, 0)
    assert len(sel.samples) == 2 and len(tb.minibatches) == 4
    assert [b.num_sequences for b in tb.minibatches] == [1, 1, 1, 1]
    for filler in tb.minibatches[2:]:
        assert float(filler.masked("weights").abs().sum()) == 0.0
        assert float(filler.seq_fields["advantages"].abs().sum()) == 0.0
    empty = ShardPlanner(algo("darl", b=2, ppo_minibatches=3), ReplayConfig(k=4), shard=0, num_shards=2)
    _, _, _, tb = run_step(empty, [], 0, 0)
    assert tb.filler and len(tb.minibatches) == 3
    assert all(float(b.masked("weights").abs().sum()) == 0.0 for b in tb.minibatches)


def test_naive_async_needs_no_logprob_pass():
    p = ShardPlanner(algo("async", b=2), ReplayConfig(k=3, max_replays=1))
    assert not p.needs_pass
    p.receive([make_group(1, 0), make_group(2, 1)], 1, 1)
    cand = p.candidate_batch()
    sel = p.select(1, p.score(cand, 1), 1)  # no store_logprobs: fifo needs no pi_t
    assert [e.group_id for e in sel.entries] == [2, 1]  # freshest first
    tb = p.training_batch(sel, sel.version_tokens, 1)
    assert torch.equal(tb.batch.masked("logp_base"), torch.cat([s.behavior_logprobs for s in sel.samples]))
    assert torch.equal(tb.batch.masked("weights"), torch.ones(tb.batch.num_loss_tokens))
    tis = ShardPlanner(algo("async", b=2, rollout_is=2.0), ReplayConfig(k=3, max_replays=1))
    assert tis.needs_pass
    tis.receive([make_group(1, 0)], 1, 1)
    with pytest.raises(ValueError, match="no log-prob pass"):
        tis.training_batch(tis.select(1, tis.score(tis.candidate_batch(), 1), 1),
                           torch.tensor([1.0, 1.0, 1.0]), 1)


def test_oldest_selected_and_cache_rows_by_source():
    p = ShardPlanner(algo("darl", b=3), ReplayConfig(k=4))
    _, _, sel, tb = run_step(p, [make_group(1, 1), make_group(2, 2), make_group(3, 3)], 3, 3)
    assert p.selection_sums(sel, 3)["selected_staleness_max"] == 2.0  # version 1 at t = 3
    q = ShardPlanner(algo("darl"), ReplayConfig())
    assert q.selection_sums(q.select(3, {}, 3), 3)["selected_staleness_max"] == -1.0  # none
    counts = p.evict(4)
    n, fresh = len(sel.samples), len(p.buffer.entry(3).group.samples)
    assert counts["cache_rows_engine"] == n and counts["cache_rows_snapshot"] > 0
    # the pass at t = 3 adds a trainer row except where the engine row of version 3 is kept
    assert counts["cache_rows_trainer"] == n - fresh and counts["cache_rows_nearest"] == 0
    assert sum(counts[f"cache_rows_{s}"] for s in ("engine", "trainer", "snapshot", "nearest")) == len(p.cache)


def test_capped_weights_counted_in_both_cap_modes():
    for mode in ("clip", "mask"):
        p = ShardPlanner(algo("decoupled", b=2, mis=MisConfig(clip=1.01, cap_mode=mode)), ReplayConfig(k=3))
        p.receive([make_group(1, 0), make_group(2, 0)], 2, 2)
        cand = p.candidate_batch()
        p.store_logprobs(cand, fake_pass(cand.batch, cand.samples, 2), 2)
        sel = p.select(2, p.score(cand, 2), 2)
        tb = p.training_batch(sel, sel.version_tokens, 2)
        w = tb.batch.masked("weights")
        over = int((w >= 1.01).sum()) if mode == "clip" else int((w == 0).sum())
        assert tb.sums["w_clipped"] == over > 0, mode
