"""Which buffered groups a step's log-prob pass scores: by default every one that can be selected.

A ratio score (chi2, kl, ess) needs log pi_t of a group's tokens, and pi_t changes every step,
so the selection the spec asks for (docs/algorithm.md: among buffered groups, the B/DP lowest
scores at t) scores the whole buffer: one forward pass over every eligible group of the window at
every step, about K times the arrivals, where decoupled PPO scores only the arrivals.
``replay.rescore`` picks the rule:

    all       (default) score every candidate at t and select the lowest scores: the spec's
              selection, exact by construction.
    selected  (opt-in heuristic) score the fresh groups (never scored: arrivals, groups buffered
              during warmup or restored without scores); rank fresh scores and old *predictions*
              together; re-score the old groups among the best ``quota`` (they need log pi_t for
              the loss anyway); select from what was scored at t. One pass over the arrivals, one
              over at most ``quota`` old groups. No guarantee: an old group predicted too high is
              never looked at.
    bounded   (opt-in) after the fresh + best predicted old groups, re-score in rounds every old
              group whose prediction is <= tau, the quota-th lowest score so far, until none is.
              Exact only where every prediction is a true lower bound of the group's score at t
              (``tests/unit/test_step_candidates.py``); scores more than ``selected``.

The prediction (``extrapolate``): a group scored at t' (age t' - v > 0) is predicted at t as
``score * (t - v) / (t' - v)``. The motivation: chi2 of pi_t against mu_v is, to second order, a
quadratic form in theta_t - theta_v, which over updates that do not undo each other grows at
least linearly in t - v. Nothing enforces that: updates that undo each other, a policy moving back
towards an old behavior, or plain noise in a score of a few samples make a score fall below its
prediction, and then both opt-in rules can miss a group the exact selection takes.

Old groups a rule leaves out keep their previous score and stay buffered; they are not selectable
at this step. ``replay.rescore_audit: true`` scores every candidate, selects from all of them, and
reports what the configured rule would have selected from the same scores (``rescore_agreement``:
the share of the exact selection it keeps; ``rescore_score_gap``: its mean selected score minus
the exact one; ``rescore_rule_scored``: groups it would have scored), the measured price of the
rule on a real run (``benchmarks/rescore_audit.py``). The rules and the selection are plain
functions of the scores, so every rerun of a step makes the same choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

RESCORE_MODES = ("selected", "bounded", "all")  # replay.rescore values (config names: keep stable)
ScoreFn = Callable[[list[int]], Mapping[int, float]]  # group ids -> their scores at t
RankFn = Callable[[Mapping[int, float]], list[int]]  # scores -> the selection (ids, best first)
Predicted = Sequence[tuple[int, float]]  # (group_id, predicted score at t) of old groups, best first


def extrapolate(score: float, behavior_version: int, scored_version: int, version: int) -> float:
    """The predicted score at ``version`` of a score taken at ``scored_version``: scaled linearly
    by age (a score taken at age 0 measures only the engine/trainer mismatch and is kept as it
    is). A prediction, not a bound: the score at ``version`` may come out lower."""
    age_then, age_now = scored_version - behavior_version, version - behavior_version
    if age_then <= 0 or age_now <= age_then:
        return score
    return score * age_now / age_then


@dataclass
class Rounds:
    """The scores at t of the groups a rule scored, and how many passes it took."""

    scores: dict[int, float]  # group_id -> score at t
    rounds: int  # log-prob passes (0: nothing to score)


def quota_threshold(scores: Mapping[int, float], quota: int) -> float:
    """The quota-th lowest score: a group scoring above it cannot be selected (inf if fewer)."""
    if quota < 1 or len(scores) < quota:
        return math.inf
    return sorted(scores.values())[quota - 1]


def bounded_rounds(fresh: Sequence[int], predicted: Predicted, quota: int, score: ScoreFn) -> Rounds:
    """Score ``fresh`` and every old group whose prediction is at most the quota-th lowest score.

    Selects exactly what scoring every candidate selects when each prediction is a lower bound
    of the group's score at t (a group left out then scores above the threshold); where a score
    fell below its prediction it can miss that group.

    Args:
        fresh: groups that must be scored (never scored before).
        predicted: (group_id, prediction) of the old groups, best first (lowest, then fresher).
        quota: groups this shard selects (B / DP).
        score: scores a list of groups at t (one log-prob pass over them).
    """
    take = max(0, quota - len(fresh))
    batch = list(fresh) + [gid for gid, _ in predicted[:take]]
    rest = list(predicted[take:])
    scores: dict[int, float] = {}
    rounds = 0
    while batch:
        scores.update(score(batch))
        rounds += 1
        tau = quota_threshold(scores, quota)
        batch = [gid for gid, pred in rest if pred <= tau]
        rest = [(gid, pred) for gid, pred in rest if pred > tau]
    return Rounds(scores, rounds)


def selected_rounds(fresh: Sequence[int], predicted: Predicted, score: ScoreFn, rank: RankFn) -> Rounds:
    """Score ``fresh``, then only the old groups the predictions put in the selection.

    A heuristic: exact when the predictions come true (scores equal to them), otherwise it can
    miss an old group predicted above the selection that scores below it at t.
    """
    scores: dict[int, float] = dict(score(list(fresh))) if fresh else {}
    old = [gid for gid in rank({**dict(predicted), **scores}) if gid not in scores]
    if old:
        scores.update(score(old))
    return Rounds(scores, int(bool(fresh)) + int(bool(old)))


def rescore(rule: str, fresh: Sequence[int], predicted: Predicted, quota: int,
            score: ScoreFn, rank: RankFn) -> Rounds:
    """The scores at t that ``rule`` (``replay.rescore``) computes with ``score``: every
    candidate for ``all``; for the opt-in rules, the ones their predictions let through."""
    if rule == "all":
        ids = list(fresh) + [gid for gid, _ in predicted]
        return Rounds(dict(score(ids)) if ids else {}, int(bool(ids)))
    if rule == "selected":
        return selected_rounds(fresh, predicted, score, rank)
    if rule == "bounded":
        return bounded_rounds(fresh, predicted, quota, score)
    raise ValueError(f"replay.rescore={rule!r}: use one of {RESCORE_MODES}")


@dataclass
class Audit:
    """What a rule would have selected from the exact scores of one step."""

    agreement: float  # |its selection & exact selection| / |exact selection| (1.0: none)
    score_gap: float  # mean exact score of its selection minus that of the exact one
    scored: int  # groups it would have scored


def audit_rule(rule: str, fresh: Sequence[int], predicted: Predicted, quota: int,
               exact: Mapping[int, float], rank: RankFn) -> Audit:
    """Replay ``rule`` against the exact scores and compare the two selections.

    ``predicted`` are the old groups' predictions as the rule saw them, ``exact`` every
    candidate's score at t; ``rank(scores)`` is the shard's selection from ``scores`` (group ids,
    best first), without counting it.
    """
    ruled = rescore(rule, fresh, predicted, quota, lambda ids: {gid: exact[gid] for gid in ids}, rank)
    want, got = rank(exact), rank(ruled.scores)
    if not want:
        return Audit(1.0, 0.0, len(ruled.scores))
    mean = lambda ids: sum(exact[g] for g in ids) / max(len(ids), 1)  # noqa: E731
    return Audit(len(set(want) & set(got)) / len(want), mean(got) - mean(want), len(ruled.scores))
