"""The wait's passes (``step/prefetch.py``): rows computed while the trainer waits change nothing.

Two planners see the same groups step by step; one computes rows while it "waits" (before each
step, with part of the step's groups already received), the other does not. The fake trainer
(``test_step_planner.fake_logprobs``) records every (sample, version) row it computes, so the
test checks the property the wait relies on: the same selection and the same loss inputs, bit
for bit, no row computed twice over the whole run, and less work left on the step's critical
path.
"""

import pytest
import torch

from test_step_planner import algo, fake_logprobs, make_group

from megatron_darl.loop.metrics import step_metrics
from megatron_darl.step.config import ReplayConfig
from megatron_darl.step.planner import ShardPlanner
from megatron_darl.step.prefetch import predicted_selection
from megatron_darl.trainer.batch import TrainBatch

STEPS, K = 7, 4


class CountingTrainer:
    """``fake_logprobs`` that records each row it computes: (sample's first token ids, version)."""

    def __init__(self) -> None:
        self.rows: list[tuple[tuple, int]] = []
        self.calls = 0

    def __call__(self, batch: TrainBatch, version: int) -> torch.Tensor:
        self.calls += 1
        for ids in torch.split(batch.input_ids, batch.seq_lens.tolist()):
            self.rows.append((tuple(ids.tolist()), version))
        return fake_logprobs(batch, version)


def arrivals(step: int) -> list:
    """Two groups a step, one of them a step stale, rewards varied so none is degenerate."""
    out = []
    for j in range(2):
        gid = 100 * step + j
        rewards = (1.0, 0.0, float(j), float(step % 2))
        out.append(make_group(gid, max(step - j, 0), rewards=rewards, seed=step))
    return out


def run(variant: str, prefetch: bool, rescore: str = "all", snapshots: bool = True):
    trainer = CountingTrainer()
    p = ShardPlanner(algo(variant, b=2, max_staleness=2), ReplayConfig(k=K, rescore=rescore))
    plans, stats = [], []
    for step in range(STEPS):
        version = step
        exact = range(max(0, version - K + 1), version) if snapshots else ()
        groups = arrivals(step)
        if prefetch:  # the first group arrived while the trainer waits for the second
            while p.prefetch(groups[:1], step, version, trainer, exact, max_tokens=12):
                pass
        plan = p.step(groups, step, version, trainer, exact)
        p.evict(version + 1, plan.stats)
        plans.append(plan)
        stats.append(plan.stats)
    return plans, stats, trainer


@pytest.mark.parametrize("variant,rescore", [("darl", "all"), ("darl", "selected"), ("decoupled", "all"),
                                             ("darl_nofilter", "all")])
def test_the_wait_changes_no_choice_and_no_number(variant, rescore):
    base, base_stats, _ = run(variant, prefetch=False, rescore=rescore)
    got, got_stats, trainer = run(variant, prefetch=True, rescore=rescore)
    for a, b in zip(base, got):
        assert [e.group_id for e in a.selection.entries] == [e.group_id for e in b.selection.entries]
        for name in ("logp_base", "weights", "advantages"):
            assert torch.equal(getattr(a.loss_inputs, name), getattr(b.loss_inputs, name)), name
    for a, b in zip(base_stats, got_stats):
        if variant == "darl":  # every arrival is scored either way: the same mismatch tokens
            assert a.mismatch_tokens == b.mismatch_tokens
            assert a.mismatch_k3_sum == pytest.approx(b.mismatch_k3_sum, abs=1e-9)
        else:  # the wait also passes arrivals the step does not select: more tokens measured
            assert b.mismatch_tokens >= a.mismatch_tokens
        assert b.rows_duplicate == 0 and a.rows_duplicate == 0
    assert len(trainer.rows) == len(set(trainer.rows)), "a row was computed twice"
    waited = sum(s.rows_prefetched for s in got_stats)
    assert waited > 0 and sum(s.prefetch_passes for s in got_stats) > 0
    assert sum(s.rows_computed for s in got_stats) < sum(s.rows_computed for s in base_stats)


def test_no_row_is_computed_twice_and_the_hit_rate_is_reported():
    _, stats, trainer = run("darl", prefetch=False)
    assert len(trainer.rows) == len(set(trainer.rows))
    later = [step_metrics(s) for s in stats[2:]]
    for m in later:
        assert m["logprob_rows_duplicate"] == 0
        assert 0 < m["logprob_cache_hit_rate"] < 1  # replayed groups' rows of earlier steps are reused
        assert m["logprob_rows_reused"] > 0
    # one pass scores every candidate: the backfill passes are one per version at most
    assert all(s.logprob_passes == 1 for s in stats[1:])


def test_the_wait_takes_received_groups_first_then_candidates_then_snapshots():
    trainer = CountingTrainer()
    p = ShardPlanner(algo("darl", b=2, max_staleness=2), ReplayConfig(k=K))
    plan = p.step(arrivals(0) + arrivals(1), 0, 0, trainer)  # four groups of versions 0 and 1
    p.evict(1, plan.stats)
    trainer.rows.clear()
    received = arrivals(3)[:1]
    versions = []
    while p.prefetch(received, 3, 3, trainer, exact_versions=(1, 2), max_tokens=10**6):
        versions.append(trainer.rows[-1][1])
    first_ids = {tuple(torch.cat([s.prompt_ids, s.response_ids]).tolist()) for s in received[0].samples}
    assert {ids for ids, _ in trainer.rows[: len(first_ids)]} == first_ids  # received first
    assert versions[:2] == [3, 3]  # then every buffered candidate at t
    assert versions[2:] == [2, 1]  # then the predicted selection at the older versions, newest first
    chosen = [s.sample_id for e in predicted_selection(p, 3, 3) for s in e.group.samples]
    assert not p.cache.missing(chosen, [1, 2], trainer=True)  # own versions too: the posterior's rows
    own = [(tuple(torch.cat([s.prompt_ids, s.response_ids]).tolist()), 1) for e in predicted_selection(p, 3, 3)
           for s in e.group.samples if s.behavior_version == 1]
    assert own and set(own) <= set(trainer.rows)  # a version-1 group's own row, computed in the wait
    assert not p.prefetch(received, 3, 3, trainer, exact_versions=(1, 2))  # nothing left


def test_naive_async_waits_without_passes():
    trainer = CountingTrainer()
    p = ShardPlanner(algo("async", b=2, max_staleness=2), ReplayConfig(k=3, max_replays=1))
    assert not p.prefetch(arrivals(0), 0, 0, trainer)
    assert trainer.calls == 0
