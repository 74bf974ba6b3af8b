"""Log-prob rows a step will need, computed while the trainer waits for the step's groups.

An async trainer that outpaces its engines waits for groups every step (Qwen3-1.7B, 2:2 H200s,
vLLM, 32 x 8 x 1024: decoupled waited 1.3 s of a 6.4 s step), and then does the step's forward
passes on the critical path: log pi_t of every scored candidate, then the backfill rows of older versions for the
selected samples. Most of those rows do not depend on the groups still to come: the buffered
candidates are known, and so are the groups already received in this wait. So while it waits,
the hub computes them, one bounded pass at a time, most certain first:

    1. log pi_t of the groups received so far in this wait (every variant with a pass scores
       or trains its arrivals)
    2. log pi_t of the buffered candidates the step will score (``replay.rescore=all``: every
       eligible group; other rules: the never-scored ones; scores that read no pi_t: the
       groups they will likely select)
    3. rows of older window versions (parameter snapshots) for the groups predicted to be
       selected: those that rank best on what is known so far, their own behavior version
       included where the mixture's posterior reads the trainer's row of it (``backfill.py``)

Rows land where the step reads them: ``CurrentRows`` (log pi_t by sample, whatever the sample's
own version) and the log-prob cache (older versions), so no row is ever computed twice and the
step's own pass covers only what the wait did not reach. A pass is at most ``max_tokens`` tokens,
so a step whose groups arrive mid-pass waits at most one short pass. Once the groups are in,
nothing here runs: a trainer-bound loop (no wait) does exactly the work it did before. Measured
on that decoupled run: 0.39 s of passes a step moved into the wait; darl with exact selection is
trainer-bound there (no wait to use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch

from megatron_darl.algorithms import RATIO_SCORES, VariantSpec, WeightRule
from megatron_darl.replay import BufferEntry, LogProbCache, ReplayBuffer, RowSource, VersionWindow
from megatron_darl.samples import PackedSamples, Sample, SampleGroup, pack_samples
from megatron_darl.step.config import ReplayConfig
from megatron_darl.step.selection import Candidates
from megatron_darl.step.sequences import pack
from megatron_darl.trainer.batch import TrainBatch

LogProbFn = Callable[[TrainBatch, int], torch.Tensor]  # (batch, version) -> (n,) packed log-probs


class CurrentRows:
    """log pi_t of samples under the trainer's current version t, by sample id.

    Kept apart from the cache because the wait computes rows of groups not buffered yet (a wait
    that a signal cuts never buffers them, so their rows must not enter the cache); the step's
    pass and ``_keep_current_rows`` put them into the cache's trainer slot (beside the engine row
    of a sample generated at exactly t). Cleared when the version moves on (``at``).
    """

    def __init__(self) -> None:
        self.version = -1
        self._rows: dict[int, torch.Tensor] = {}  # sample_id -> (T_i,) float32

    def at(self, version: int) -> "CurrentRows":
        """These rows for ``version``: emptied when it is not the version they hold."""
        if version != self.version:
            self._rows.clear()
            self.version = version
        return self

    def has(self, sample: Sample) -> bool:
        return sample.num_tokens == 0 or sample.sample_id in self._rows

    def get(self, sample: Sample) -> torch.Tensor:
        if sample.num_tokens == 0:
            return torch.zeros(0, dtype=torch.float32)
        return self._rows[sample.sample_id]

    def holds(self, sample_id: int) -> bool:
        return sample_id in self._rows

    def put(self, sample: Sample, row: torch.Tensor) -> None:
        self._rows[sample.sample_id] = row

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)


@dataclass
class Work:
    """One bounded pass: ``samples`` (packed as ``packed``) scored under ``version``."""

    samples: list[Sample]
    packed: PackedSamples
    version: int

    @property
    def tokens(self) -> int:
        return int(self.packed.seq_lens.sum())


def take(pieces: Iterable[tuple[Sample, Callable[[], PackedSamples]]], max_tokens: int,
         version: int) -> Work | None:
    """The first samples of ``pieces`` whose prompt + response tokens stay within ``max_tokens``
    (at least one), packed end to end; None when there are none. Each piece is a sample and how to
    get it packed (a view of its group's packing, or a packing of its own)."""
    samples: list[Sample] = []
    parts: list[PackedSamples] = []
    tokens = 0
    for sample, packed in pieces:
        need = sample.prompt_ids.shape[0] + sample.num_tokens
        if samples and tokens + need > max_tokens:
            break
        samples.append(sample)
        parts.append(packed())
        tokens += need
    if not samples:
        return None
    return Work(samples, PackedSamples.concat(parts, rows=False), version)


def entry_pieces(entries: Sequence[BufferEntry], want: Callable[[Sample], bool]):
    """(sample, its packed view) of the samples of buffered ``entries`` that ``want`` accepts."""
    for e in entries:
        for i, s in enumerate(e.group.samples):
            if s.num_tokens and want(s):
                yield s, (lambda e=e, i=i: e.packed.slice(i, i + 1))


def group_pieces(groups: Sequence[SampleGroup], want: Callable[[Sample], bool]):
    """The same for groups not buffered yet (received in this wait): each sample packed alone."""
    for g in groups:
        for s in g.samples:
            if s.num_tokens and want(s):
                yield s, (lambda s=s: pack_samples([s]))


def snapshot_pieces(entries: Sequence[BufferEntry], versions: Sequence[int], cache: LogProbCache,
                    max_tokens: int, own: bool = False) -> Work | None:
    """The first version of ``versions`` (in order) some sample of ``entries`` lacks a cache row
    of, as one pass over those samples (at most ``max_tokens``); with ``own`` a trainer row of
    the sample's own version too, beside its engine row (the prefix posterior's, ``backfill.py``)."""
    for v in versions:
        lacks = lambda s, v=v: not cache.has(s.sample_id, v, trainer=own)  # noqa: E731
        work = take(entry_pieces(entries, lacks), max_tokens, v)
        if work is not None:
            return work
    return None


@dataclass
class RowCounts:
    """Rows (sample x version) by where the step got them; a row computed twice is a bug."""

    computed: int = 0  # computed on the step's critical path (its pass, its backfill)
    prefetched: int = 0  # computed while the trainer waited for the step's groups
    reused: int = 0  # needed by the step and already there (the wait, an earlier step, the engine)
    duplicate: int = 0  # computed although the row existed: must stay 0


def store_rows(samples: Sequence[Sample], logp: torch.Tensor, version: int, current: CurrentRows,
               cache: LogProbCache) -> tuple[list[torch.Tensor], int]:
    """Put a pass's packed ``(n,)`` rows where the step reads them: at the current version into
    ``current`` (the step's pass puts them into the cache once their groups are buffered: a
    group received in a wait that a signal cuts never enters the buffer, so its rows must not
    enter the cache either), at an older version into the cache as snapshot rows. Returns the
    per-sample rows and how many of them existed already (duplicates: must stay 0)."""
    rows = list(torch.split(logp.to(torch.float32), [s.num_tokens for s in samples]))
    duplicates = 0
    for s, row in zip(samples, rows, strict=True):
        exact = cache.source(s.sample_id, version, trainer=True) in (RowSource.TRAINER, RowSource.SNAPSHOT)
        if version == current.version:
            duplicates += int(exact or current.holds(s.sample_id))
            current.put(s, row)
        else:
            duplicates += int(exact)
            cache.put(s.sample_id, version, row, RowSource.SNAPSHOT)
    return rows, duplicates


class WaitingShard(Protocol):
    """What the wait reads of a shard's planner (``planner.ShardPlanner``), and the one thing it
    writes: ``predicted``, its last predicted selection, kept until another row is known."""

    spec: VariantSpec
    replay: ReplayConfig
    window: VersionWindow
    buffer: ReplayBuffer
    cache: LogProbCache
    current: CurrentRows
    shard: int
    quota: int  # the groups this shard selects per step
    own_trainer_rows: bool  # the posterior reads the trainer's row of a sample's own version
    predicted: tuple[tuple[int, int, int], list[BufferEntry]] | None  # (step, version, rows at t)

    def candidates_of(self, entries: list[BufferEntry]) -> Candidates: ...

    def score(self, cand: Candidates, step: int) -> dict[int, float]: ...


def next_work(planner: WaitingShard, received: Sequence[SampleGroup], step: int, version: int,
              exact: set[int], max_tokens: int) -> Work | None:
    """The wait's next pass for ``planner``'s shard, most certain first: the received groups at
    t, the candidates the step will score at t, then the older versions (snapshots) the predicted
    selection lacks, newest first; None when nothing is left."""
    current = planner.current
    lacks = lambda s: not current.has(s)  # noqa: E731
    oldest = planner.window.oldest(version)
    fresh = [g for g in received if g.behavior_version >= oldest and g.group_id not in planner.buffer]
    work = take(group_pieces(fresh, lacks), max_tokens, version)
    if work is None:
        work = take(entry_pieces(likely_scored(planner, step, version), lacks), max_tokens, version)
    if work is not None or planner.spec.weight_rule is not WeightRule.MIXTURE:
        return work
    older = sorted((v for v in planner.window.versions(version) if v != version and v in exact), reverse=True)
    return snapshot_pieces(predicted_selection(planner, step, version), older, planner.cache, max_tokens,
                           own=planner.own_trainer_rows)


def likely_scored(planner: WaitingShard, step: int, version: int) -> list[BufferEntry]:
    """Buffered groups the step will pass at t: every candidate a ratio score scores
    (``replay.rescore``), else those the variant will likely select."""
    entries = planner.buffer.candidates(planner.shard)
    if planner.spec.score in RATIO_SCORES and not planner.buffer.in_warmup(step):
        if planner.replay.rescore == "all" or planner.replay.rescore_audit:
            return entries
        return [e for e in entries if e.score is None]
    return predicted_selection(planner, step, version)


def predicted_selection(planner: WaitingShard, step: int, version: int) -> list[BufferEntry]:
    """The selection the shard would make from what is known now (a ratio score: the candidates
    with every row at t), best first; remembered by the planner until another row is known."""
    key = (step, version, len(planner.current))
    if planner.predicted is not None and planner.predicted[0] == key:
        return planner.predicted[1]
    buffer, current = planner.buffer, planner.current
    entries = buffer.candidates(planner.shard)
    scores: dict[int, float] | None = None
    if entries and not buffer.in_warmup(step):
        if planner.spec.score in RATIO_SCORES:
            entries = [e for e in entries if all(current.has(s) for s in e.group.samples)]
            cand = planner.candidates_of(entries) if entries else None
            if cand is not None:
                cand.logp_t = pack([current.get(s) for s in cand.samples])
        else:
            cand = planner.candidates_of(entries)
        scores = planner.score(cand, step) if cand is not None else {}
    chosen = buffer.rank(step, planner.quota, scores, [planner.shard]) if entries else []
    planner.predicted = (key, chosen)
    return chosen
