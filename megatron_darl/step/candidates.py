"""Which buffered groups a step's log-prob pass scores: those that can be selected.

A ratio score (chi2, kl, ess) needs log pi_t of a group's tokens, and pi_t changes every step,
so scoring the whole buffer is one forward pass over every eligible group of the window at every
step: about K times the arrivals, where decoupled PPO scores only the arrivals. Selection takes
the B/DP lowest scores, and a group's score grows with its age: chi2 of pi_t against mu_v is, to
second order, a quadratic form in theta_t - theta_v, which over updates that do not undo each
other grows at least linearly in t - v. So a group scored at t' (age t' - v > 0) is predicted at
t as ``score * (t - v) / (t' - v)`` (``extrapolate``), and ``replay.rescore`` picks the rule:

    selected  (default) score the fresh groups (never scored: arrivals, groups buffered during
              warmup or restored without scores); rank fresh scores and old predictions together;
              re-score the old groups among the best ``quota`` (they need log pi_t for the loss
              anyway); select from what was scored at t. One pass over the arrivals, one over at
              most ``quota`` old groups.
    bounded   treat the prediction as a lower bound: after the fresh + best old groups, re-score
              in rounds every old group whose prediction is <= tau, the quota-th lowest score so
              far, until none is. Exact where the bound holds; scores more.
    all       score every candidate (the rule before; exact by construction).

Old groups left out keep their previous score and stay buffered; they are not selectable at this
step. A rule can miss a group whose score fell (updates that undo each other, a policy moving
back towards an old behavior): ``replay.rescore_audit: true`` scores every candidate, selects
from all of them, and reports what the configured rule would have selected from the same
scores (``rescore_agreement``: the share of the exact selection it keeps; ``rescore_score_gap``:
its mean selected score minus the exact one; ``rescore_rule_scored``: groups it would have
scored), the measured price of the rule on a real run. The rules and the selection are plain
functions of the scores, so every rerun of a step makes the same choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

RESCORE_MODES = ("selected", "bounded", "all")
ScoreFn = Callable[[list[int]], Mapping[int, float]]  # group ids -> their scores at t
RankFn = Callable[[Mapping[int, float]], list[int]]  # scores -> the selection (ids, best first)


def extrapolate(score: float, behavior_version: int, scored_version: int, version: int) -> float:
    """The bound at ``version`` of a score taken at ``scored_version``: scaled linearly by age
    (a score taken at age 0 measures only the engine/trainer mismatch and is kept as it is)."""
    age_then, age_now = scored_version - behavior_version, version - behavior_version
    if age_then <= 0 or age_now <= age_then:
        return score
    return score * age_now / age_then


@dataclass
class Rounds:
    """The scores of the groups a bounded pass scored, and how many passes it took."""

    scores: dict[int, float]  # group_id -> score at t
    rounds: int  # log-prob passes (0: nothing to score)


def quota_threshold(scores: Mapping[int, float], quota: int) -> float:
    """The quota-th lowest score: a group scoring above it cannot be selected (inf if fewer)."""
    if quota < 1 or len(scores) < quota:
        return math.inf
    return sorted(scores.values())[quota - 1]


def bounded_rounds(fresh: Sequence[int], prior: Sequence[tuple[int, float]], quota: int,
                   score: ScoreFn) -> Rounds:
    """Score ``fresh`` and as few of the old groups as the bound allows.

    Args:
        fresh: groups that must be scored (never scored before).
        prior: (group_id, bound) of the old groups, best first (lowest bound, then fresher).
        quota: groups this shard selects (B / DP).
        score: scores a list of groups at t (one log-prob pass over them).
    """
    take = max(0, quota - len(fresh))
    batch = list(fresh) + [gid for gid, _ in prior[:take]]
    rest = list(prior[take:])
    scores: dict[int, float] = {}
    rounds = 0
    while batch:
        scores.update(score(batch))
        rounds += 1
        tau = quota_threshold(scores, quota)
        batch = [gid for gid, prev in rest if prev <= tau]
        rest = [(gid, prev) for gid, prev in rest if prev > tau]
    return Rounds(scores, rounds)


def selected_rounds(fresh: Sequence[int], prior: Sequence[tuple[int, float]], score: ScoreFn,
                    rank: RankFn) -> Rounds:
    """Score ``fresh``, then only the old groups the predictions put in the selection."""
    scores: dict[int, float] = dict(score(list(fresh))) if fresh else {}
    old = [gid for gid in rank({**dict(prior), **scores}) if gid not in scores]
    if old:
        scores.update(score(old))
    return Rounds(scores, int(bool(fresh)) + int(bool(old)))


def rescore(rule: str, fresh: Sequence[int], prior: Sequence[tuple[int, float]], quota: int,
            score: ScoreFn, rank: RankFn) -> Rounds:
    """The scores at t that ``rule`` (``replay.rescore``) computes with ``score``."""
    if rule == "selected":
        return selected_rounds(fresh, prior, score, rank)
    if rule == "bounded":
        return bounded_rounds(fresh, prior, quota, score)
    if rule == "all":
        ids = list(fresh) + [gid for gid, _ in prior]
        return Rounds(dict(score(ids)) if ids else {}, int(bool(ids)))
    raise ValueError(f"replay.rescore={rule!r}: use one of {RESCORE_MODES}")


@dataclass
class Audit:
    """What a rule would have selected from the exact scores of one step."""

    agreement: float  # |its selection & exact selection| / |exact selection| (1.0: none)
    score_gap: float  # mean exact score of its selection minus that of the exact one
    scored: int  # groups it would have scored


def audit_rule(rule: str, fresh: Sequence[int], prior: Sequence[tuple[int, float]], quota: int,
               exact: Mapping[int, float], rank: RankFn) -> Audit:
    """Replay ``rule`` against the exact scores and compare the two selections.

    ``rank(scores)`` is the shard's selection from ``scores`` (group ids, best first), without
    counting it.
    """
    ruled = rescore(rule, fresh, prior, quota, lambda ids: {gid: exact[gid] for gid in ids}, rank)
    want, got = rank(exact), rank(ruled.scores)
    if not want:
        return Audit(1.0, 0.0, len(ruled.scores))
    mean = lambda ids: sum(exact[g] for g in ids) / max(len(ids), 1)  # noqa: E731
    return Audit(len(set(want) & set(got)) / len(want), mean(got) - mean(want), len(ruled.scores))
