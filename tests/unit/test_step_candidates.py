"""The rules of ``step/candidates.py``: ``all`` (the default) scores every candidate; ``bounded``
scores fewer and selects exactly what ``all`` selects wherever the predicted scores are lower
bounds, even bounds that never come true exactly; ``selected`` is a heuristic; where a score falls
below its prediction, both miss groups and ``audit_rule`` measures by how much.
"""

import random

import torch

from megatron_darl.step.candidates import (
    Audit, audit_rule, bounded_rounds, extrapolate, quota_threshold, rescore, selected_rounds,
)
from megatron_darl.step.config import ReplayConfig
from megatron_darl.step.planner import ShardPlanner
from tests.unit.test_step_planner import algo, fake_logprobs, make_group


def _rank(quota):
    """Lowest score first, ties to the higher id (the fresher group in these instances)."""
    return lambda scores: [g for g, _ in sorted(scores.items(), key=lambda kv: (kv[1], -kv[0]))][:quota]


def _instance(rng: random.Random):
    """A random quota, old groups with their previous scores, arrivals, and the old groups ranked."""
    quota = rng.randint(1, 6)
    old = {g: rng.random() for g in range(rng.randint(0, 20))}
    fresh = list(range(100, 100 + rng.randint(0, 8)))
    return quota, old, fresh, sorted(old.items(), key=lambda kv: (kv[1], -kv[0]))


def test_monotone_scores_select_exactly_what_scoring_everything_selects():
    rng = random.Random(0)
    for trial in range(300):
        quota, old, fresh, prior = _instance(rng)
        now = {g: prev + rng.random() * rng.choice([0.0, 0.1, 1.0]) for g, prev in old.items()}
        now.update({g: rng.random() for g in fresh})
        calls = []
        got = bounded_rounds(fresh, prior, quota, lambda ids: calls.append(ids) or {g: now[g] for g in ids})
        assert _rank(quota)(got.scores) == _rank(quota)(now), trial
        assert set(fresh) <= set(got.scores) and got.rounds == len(calls)
        assert len(got.scores) == sum(len(c) for c in calls)  # nothing scored twice
        # every old group left out could not have been selected: its prior is above the threshold
        tau = quota_threshold(got.scores, quota)
        assert all(old[g] > tau for g in old if g not in got.scores), trial


def _by_rule(rule, fresh, prior, quota, now):
    """What ``rule`` selects when the scores at t are ``now``, and how many groups it scored."""
    got = rescore(rule, fresh, prior, quota, lambda ids: {g: now[g] for g in ids}, _rank(quota))
    return _rank(quota)(got.scores), len(got.scores)


def test_strict_lower_bounds_that_never_come_true_keep_bounded_exact():
    rng = random.Random(2)
    scored = {"all": 0, "bounded": 0}
    selected_missed = 0
    for trial in range(400):
        quota, old, fresh, prior = _instance(rng)
        if trial % 2:  # true score = prediction * (1 + a positive margin)
            now = {g: pred * (1 + rng.uniform(0.01, 1.0)) for g, pred in old.items()}
        else:  # true score = prediction + positive noise
            now = {g: pred + rng.uniform(1e-3, 0.5) for g, pred in old.items()}
        assert all(now[g] > pred for g, pred in old.items()), trial  # strict: never exact
        now.update({g: rng.random() for g in fresh})
        want, n_all = _by_rule("all", fresh, prior, quota, now)
        got, n_bounded = _by_rule("bounded", fresh, prior, quota, now)
        assert got == want, trial
        audit = audit_rule("bounded", fresh, prior, quota, now, _rank(quota))
        assert audit.agreement == 1.0 and audit.score_gap == 0.0 and audit.scored == n_bounded, trial
        scored["all"] += n_all
        scored["bounded"] += n_bounded
        selected_missed += _by_rule("selected", fresh, prior, quota, now)[0] != want
    assert scored == {"all": 5460, "bounded": 3688}  # the bound still leaves a third unscored
    # the heuristic trusts the predictions' order, which the margins reshuffle
    assert selected_missed == 86, selected_missed  # of 400


def test_the_bound_scores_what_can_be_selected_not_the_buffer():
    quota = 4
    old = {g: 0.5 + g / 100 for g in range(16)}  # 16 old groups, scores drifting up by 0.2
    prior = sorted(old.items(), key=lambda kv: (kv[1], -kv[0]))
    now = {g: s + 0.2 for g, s in old.items()}
    # fresh groups that fill the quota with low scores: no old group can beat them
    good = {100: 0.1, 101: 0.1, 102: 0.2, 103: 0.0}
    got = bounded_rounds(list(good), prior, quota, lambda ids: {g: {**now, **good}[g] for g in ids})
    assert set(got.scores) == set(good) and got.rounds == 1
    # three fresh groups: the best old one fills the quota in round 0 (tau = 0.7); the old groups
    # with a prior <= 0.7 follow in round 1, the rest (prior 0.51 .. 0.65 all are) too
    three = {100: 0.1, 101: 0.1, 102: 0.2}
    got = bounded_rounds(list(three), prior, quota, lambda ids: {g: {**now, **three}[g] for g in ids})
    assert got.rounds == 2 and len(got.scores) == 19
    # with old scores spread wider, only the ones under the threshold are rescored
    wide = {g: 0.5 + g / 10 for g in range(16)}
    prior = sorted(wide.items(), key=lambda kv: (kv[1], -kv[0]))
    now = {g: s + 0.2 for g, s in wide.items()}
    got = bounded_rounds(list(three), prior, quota, lambda ids: {g: {**now, **three}[g] for g in ids})
    assert set(got.scores) == {100, 101, 102, 0, 1, 2}  # tau 0.7: priors 0.6 and 0.7 rescored


def test_audit_names_the_group_a_falling_score_hides():
    quota = 2
    prior = [(1, 0.1), (2, 0.2), (3, 0.9)]  # old groups' predictions, best first
    exact = {1: 0.3, 2: 0.4, 3: 0.05, 10: 0.5}  # group 3's score fell far below its prediction
    assert _by_rule("all", [10], prior, quota, exact) == ([3, 1], 4)
    for rule in ("bounded", "selected"):  # neither re-scores 3: both take {1, 2}
        assert _by_rule(rule, [10], prior, quota, exact) == ([1, 2], 3), rule
        audit = audit_rule(rule, [10], prior, quota, exact, _rank(quota))
        assert audit.agreement == 0.5, rule  # exact takes {3, 1}
        assert abs(audit.score_gap - ((0.3 + 0.4) / 2 - (0.05 + 0.3) / 2)) < 1e-12, rule  # 0.175
        assert audit.scored == 3, rule
    assert audit_rule("all", [10], prior, quota, exact, _rank(quota)) == Audit(1.0, 0.0, 4)
    fine = audit_rule("bounded", [10], prior, quota, {1: 0.3, 2: 0.4, 3: 0.95, 10: 0.5}, _rank(quota))
    assert fine.agreement == 1.0 and fine.score_gap == 0.0


def _stream(steps, per_step, quota, rescore, start=1000, audit=False):
    """A planner fed ``per_step`` new groups per step (behavior version t - 1), the fake trainer
    drifting linearly with the version: each group's chi2 score grows with its age. ``rescore``
    None: the default rule."""
    rule = {"rescore": rescore} if rescore else {}  # None: the default rule
    p = ShardPlanner(algo("darl", b=quota, max_staleness=2), ReplayConfig(k=4, rescore_audit=audit, **rule))
    out = []
    for t in range(steps):
        groups = [make_group(start + t * per_step + i, max(t - 1, 0), seed=7) for i in range(per_step)]
        plan = p.step(groups, t, t, fake_logprobs, exact_versions=range(max(0, t - 3), t))
        out.append(plan)
        p.evict(t + 1, plan.stats)
    return p, out


def test_the_default_scores_every_candidate_as_the_spec_asks():
    assert ReplayConfig().rescore == "all"
    _, full = _stream(12, 3, 4, "all")
    _, default = _stream(12, 3, 4, None)
    for t, (a, b) in enumerate(zip(full, default)):
        assert [e.group_id for e in a.selection.entries] == [e.group_id for e in b.selection.entries], t
        assert b.stats.groups_scored == b.stats.candidate_groups > 0, t  # one pass over the buffer
        assert b.stats.logprob_passes == 1, t
    # the whole window: 3 arrivals a step at behavior version t - 1, so t - 3 .. t - 1 hold groups
    assert [p.stats.candidate_groups for p in default][-1] == 9


def test_bounded_planner_selects_and_weights_as_the_full_pass_with_fewer_groups_scored():
    _, full = _stream(12, 3, 4, "all")
    _, bounded = _stream(12, 3, 4, "bounded")
    for t, (a, b) in enumerate(zip(full, bounded)):
        assert [e.group_id for e in a.selection.entries] == [e.group_id for e in b.selection.entries], t
        torch.testing.assert_close(a.loss_inputs.weights, b.loss_inputs.weights, rtol=0, atol=0)
        torch.testing.assert_close(a.loss_inputs.logp_base, b.loss_inputs.logp_base, rtol=0, atol=0)
    scored_full = sum(p.stats.groups_scored for p in full)
    scored_bounded = sum(p.stats.groups_scored for p in bounded)
    candidates = sum(p.stats.candidate_groups for p in bounded)
    assert scored_full == candidates  # "all" scores every eligible group every step
    assert scored_bounded <= 0.85 * scored_full, (scored_bounded, scored_full)  # 82 of 102 here
    # the bound's backfill makes up rows the full pass had cached, but never more than it saved
    rows_full = scored_full + sum(p.stats.backfill_snapshot for p in full) / 4
    rows_bounded = scored_bounded + sum(p.stats.backfill_snapshot for p in bounded) / 4
    assert rows_bounded < rows_full


def test_selected_scores_the_arrivals_and_at_most_the_quota_of_old_groups():
    rng = random.Random(1)
    for trial in range(200):
        quota, old, fresh, prior = _instance(rng)
        now = {**old, **{g: rng.random() for g in fresh}}  # predictions that come true
        got = selected_rounds(fresh, prior, lambda ids: {g: now[g] for g in ids}, _rank(quota))
        assert set(fresh) <= set(got.scores) and len(got.scores) <= len(fresh) + quota
        assert _rank(quota)(got.scores) == _rank(quota)(now), trial
        assert got.rounds <= 2


def test_extrapolate_scales_by_age_and_keeps_scores_taken_at_age_zero():
    assert extrapolate(0.3, 4, 5, 7) == 0.3 * 3 / 1
    assert extrapolate(0.3, 4, 6, 7) == 0.3 * 3 / 2
    assert extrapolate(0.3, 4, 4, 7) == 0.3  # scored at its own version: mismatch only
    assert extrapolate(0.3, 4, 7, 7) == 0.3


def test_selected_on_a_drifting_run_scores_little_and_audit_measures_it():
    quota, per_step = 4, 3
    _, full = _stream(12, per_step, quota, "all")
    p, plans = _stream(12, per_step, quota, "selected", audit=True)
    from megatron_darl.loop.metrics import step_metrics

    m = [step_metrics(plan.stats) for plan in plans[1:]]
    assert all(x["rescore_rule_scored"] <= per_step + quota for x in m)
    assert all(x["groups_scored"] == x["candidate_groups"] for x in m)  # the audit scores all
    # the audit scored everything, so it trained what "all" trains
    for a, b in zip(full, plans):
        assert [e.group_id for e in a.selection.entries] == [e.group_id for e in b.selection.entries]
    agreement = sum(x["rescore_agreement"] for x in m) / len(m)
    assert agreement >= 0.9 and all(x["rescore_score_gap"] >= 0 for x in m), m
    _, sel = _stream(12, per_step, quota, "selected")
    assert sum(x.stats.groups_scored for x in sel) <= 0.7 * sum(x.stats.groups_scored for x in full)
    # scores are checkpointed with the buffer: a resumed planner ranks old groups as before
    q = ShardPlanner(algo("darl", b=quota, max_staleness=2), ReplayConfig(k=4))
    q.load_state_dict(p.state_dict())
    assert [(e.score, e.scored_version) for e in q.buffer.entries()] == \
           [(e.score, e.scored_version) for e in p.buffer.entries()]
    assert any(e.score is not None for e in q.buffer.entries())
