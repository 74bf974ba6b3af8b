"""Replay buffer over the last K behavior versions (docs/algorithm.md, sections 1-3 and 7).

Groups arrive from rollout with their advantages computed once (GRPO, per group) and are kept
while their behavior version lies in the window ``[t - K + 1, t]``; a group may be selected at
several steps while it stays there (replay), optionally capped by ``max_replays``. Each group
belongs to one DP shard (``shard_of``: each rollout worker's groups dealt round-robin over the
shards); selection takes a fixed quota per shard so sample data never moves between shards.
Scores come from the loop (they need the trainer's log-prob pass); the buffer only decides
eligibility, order and bookkeeping.

A group is packed once, when it is added (``BufferEntry.packed``: the trainer's token layout,
``samples.PackedSamples``); its samples' tensors become views of that, so the buffer holds the
group once and a step builds its batches from the packed pieces instead of re-packing samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from megatron_darl.algorithms import grpo_advantages, select_groups
from megatron_darl.replay.records import group_from_state, group_to_state
from megatron_darl.replay.window import VersionWindow
from megatron_darl.samples import PackedSamples, SampleGroup, pack_samples, share_packed, shard_of


@dataclass
class BufferEntry:
    """One buffered group and its bookkeeping."""

    group: SampleGroup
    packed: PackedSamples  # the group's samples packed once, on arrival (its samples' storage)
    advantages: torch.Tensor  # (G,) float32 GRPO advantages, fixed at arrival
    shard: int  # owning DP shard, shard_of(group_id, num_shards, num_workers) on arrival
    arrival_step: int  # trainer step at which the group arrived
    behavior_version: int  # oldest token version of the group
    arrival_seq: int  # arrival order inside the buffer (ties on freshness)
    times_selected: int = 0  # how often it went into a training batch
    score: float | None = None  # its latest selection score (None: never scored)
    scored_version: int = -1  # the version t of that score

    @property
    def group_id(self) -> int:
        return self.group.group_id

    @property
    def degenerate(self) -> bool:
        """All advantages zero (equal rewards): no policy gradient."""
        return not bool(self.advantages.any())


class ReplayBuffer:
    """Version-windowed store of ``SampleGroup``s with per-shard, score-ordered selection."""

    def __init__(
        self,
        window: VersionWindow | int,
        num_shards: int = 1,
        warmup: int = 0,
        drop_degenerate: bool = True,
        max_replays: int | None = None,
        adv_eps: float = 1e-6,
        num_workers: int = 1,
    ) -> None:
        """Args:
        window: the replay window (``replay.k``; an int is ``VersionWindow(int)``).
        num_shards: DP shards the groups are spread over.
        warmup: steps (``replay.warmup``) during which the freshest groups are taken.
        drop_degenerate: never select groups whose advantages are all zero.
        max_replays: times a group may be selected; ``None`` = unlimited while in window.
        adv_eps: eps of ``grpo_advantages``.
        num_workers: rollout workers whose groups are dealt over the shards (``shard_of``). Not
            part of the state: a restored entry keeps its stored shard, new arrivals follow the
            run's count (a resume may not change it: ``launch/resume_changes.py``).
        """
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        k = window.k if isinstance(window, VersionWindow) else window
        self._configure(k, num_shards, warmup, drop_degenerate, max_replays, adv_eps)
        self._entries: dict[int, BufferEntry] = {}  # group_id -> entry, in arrival order
        self._next_seq = 0

    def _configure(
        self, k: int, num_shards: int, warmup: int, drop_degenerate: bool,
        max_replays: int | None, adv_eps: float,
    ) -> None:
        """Validate and set the settings (shared by ``__init__`` and ``load_state_dict``)."""
        self.window = VersionWindow(k)
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if max_replays is not None and max_replays < 1:
            raise ValueError(f"max_replays must be >= 1 or None, got {max_replays}")
        self.num_shards = num_shards
        self.warmup = warmup
        self.drop_degenerate = drop_degenerate
        self.max_replays = max_replays
        self.adv_eps = adv_eps

    # ---- contents ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, group_id: int) -> bool:
        return group_id in self._entries

    def entry(self, group_id: int) -> BufferEntry:
        return self._entries[group_id]

    def entries(self, shard: int | None = None) -> list[BufferEntry]:
        """Entries in arrival order, optionally of one shard."""
        return [e for e in self._entries.values() if shard is None or e.shard == shard]

    def sample_ids(self) -> list[int]:
        return [s.sample_id for e in self._entries.values() for s in e.group.samples]

    def version_histogram(self) -> dict[int, int]:
        """Buffered groups per behavior version (for the staleness metric)."""
        hist: dict[int, int] = {}
        for e in self._entries.values():
            hist[e.behavior_version] = hist.get(e.behavior_version, 0) + 1
        return dict(sorted(hist.items()))

    # ---- arrival and eviction ---------------------------------------------------------------
    def add(self, group: SampleGroup, step: int) -> BufferEntry:
        """Buffer a group that arrived at trainer step ``step``; computes its advantages."""
        if group.group_id in self._entries:
            raise ValueError(f"group {group.group_id} is already in the replay buffer")
        if not group.samples or group.num_tokens == 0:
            raise ValueError(f"group {group.group_id} has no response tokens")
        rewards = group.rewards  # (G,)
        advantages = grpo_advantages(rewards, torch.zeros_like(rewards, dtype=torch.int64),
                                     eps=self.adv_eps)
        entry = BufferEntry(
            group=group,
            packed=_packed(group),
            advantages=advantages,
            shard=shard_of(group.group_id, self.num_shards, self.num_workers),
            arrival_step=step,
            behavior_version=group.behavior_version,
            arrival_seq=self._next_seq,
        )
        self._next_seq += 1
        self._entries[group.group_id] = entry
        return entry

    def evict(self, current_version: int) -> list[int]:
        """Drop groups left of the window at ``current_version``; return their sample ids."""
        oldest = self.window.oldest(current_version)
        gone = [gid for gid, e in self._entries.items() if e.behavior_version < oldest]
        sample_ids: list[int] = []
        for gid in gone:
            sample_ids.extend(s.sample_id for s in self._entries.pop(gid).group.samples)
        return sample_ids

    # ---- selection --------------------------------------------------------------------------
    def eligible(self, entry: BufferEntry) -> bool:
        """Selectable: non-degenerate (when dropping those) and under the replay cap."""
        if self.drop_degenerate and entry.degenerate:
            return False
        return self.max_replays is None or entry.times_selected < self.max_replays

    def candidates(self, shard: int | None = None) -> list[BufferEntry]:
        """Eligible entries (optionally of one shard): the groups the loop must score."""
        return [e for e in self.entries(shard) if self.eligible(e)]

    def in_warmup(self, step: int) -> bool:
        return step < self.warmup

    def select(self, *args, **kwargs) -> list[BufferEntry]:
        """``rank(step, quota, scores, shards)`` the groups, then count the selection
        (``times_selected``)."""
        chosen = self.rank(*args, **kwargs)
        for e in chosen:
            e.times_selected += 1
        return chosen

    def rank(
        self,
        step: int,
        quota: int,
        scores: Mapping[int, float] | None = None,
        shards: Iterable[int] | None = None,
    ) -> list[BufferEntry]:
        """The up to ``quota`` groups per shard a selection would choose; counts nothing.

        Warmup steps take the freshest eligible groups and ignore ``scores``; later steps take
        the lowest-score eligible groups, ties to the fresher (higher behavior version, then
        later arrival). Eligible groups without a score are not selected after warmup.

        Args:
            step: current trainer step t.
            quota: groups per shard (B / DP).
            scores: group_id -> group score (lower is better); required after warmup.
            shards: shards to select for (default all; a hub rank passes its own).

        Returns:
            Chosen entries, shard by shard, best first.
        """
        if quota < 0:
            raise ValueError(f"quota must be >= 0, got {quota}")
        warm = self.in_warmup(step)
        if not warm and scores is None:
            raise ValueError(f"scores are required after warmup (step {step} >= {self.warmup})")
        chosen: list[BufferEntry] = []
        for shard in range(self.num_shards) if shards is None else shards:
            pool = self.entries(shard)
            if not pool:
                continue
            eligible = torch.tensor(
                [self.eligible(e) and (warm or e.group_id in scores) for e in pool]
            )  # (M,)
            score = torch.tensor(
                [0.0 if warm or e.group_id not in scores else float(scores[e.group_id])
                 for e in pool], dtype=torch.float64,
            )  # (M,) all equal during warmup: freshness decides
            version = torch.tensor([e.behavior_version for e in pool], dtype=torch.float64)
            seq = torch.tensor([e.arrival_seq for e in pool], dtype=torch.float64)
            freshness = version * (self._next_seq + 1) + seq  # (M,) version, then arrival
            idx = select_groups(score, eligible, quota, freshness)
            chosen.extend(pool[i] for i in idx.tolist())
        return chosen

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain dict of scalars, lists and tensors (``torch.load(weights_only=True)`` works)."""
        return {
            "config": {
                "k": self.window.k, "num_shards": self.num_shards, "warmup": self.warmup,
                "drop_degenerate": self.drop_degenerate, "max_replays": self.max_replays,
                "adv_eps": self.adv_eps,
            },
            "next_seq": self._next_seq,
            "entries": [
                {
                    "group": group_to_state(e.group), "advantages": e.advantages.clone(),
                    "shard": e.shard, "arrival_step": e.arrival_step,
                    "behavior_version": e.behavior_version, "arrival_seq": e.arrival_seq,
                    "times_selected": e.times_selected, "score": e.score,
                    "scored_version": e.scored_version,
                }
                for e in self._entries.values()
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore exactly what ``state_dict`` saved (config included)."""
        cfg = state["config"]
        self._configure(**cfg)
        self._entries = {}
        self._next_seq = int(state["next_seq"])
        for raw in state["entries"]:
            group = group_from_state(raw["group"])
            entry = BufferEntry(
                group=group, packed=_packed(group), advantages=raw["advantages"].clone(),
                shard=int(raw["shard"]), arrival_step=int(raw["arrival_step"]),
                behavior_version=int(raw["behavior_version"]),
                arrival_seq=int(raw["arrival_seq"]), times_selected=int(raw["times_selected"]),
                score=raw.get("score"), scored_version=int(raw.get("scored_version", -1)),
            )
            self._entries[entry.group_id] = entry


def _packed(group: SampleGroup) -> PackedSamples:
    """The group packed, its samples' tensors made views of it (held once)."""
    packed = pack_samples(group.samples)
    share_packed(group.samples, packed)
    return packed
