"""One DP shard's D-ARL step over the replay buffer, the log-prob cache and the algorithms.

``plan = planner.step(groups, step, version, logprobs, ...)`` is the whole algorithm of a
trainer step, from the shard's new groups to the trainer's PPO mini-batches:

    arrive     buffer the new groups (GRPO advantages), engine rows into the cache
    score      per-group scores (the variant's score kind); a ratio score needs log pi_t, so
               its groups go through log-prob passes at t (``logprobs(batch, t)``), as few
               as can still be selected (``candidates.py``, ``replay.rescore``)
    select     the shard's quota B/DP (warmup: freshest first); per-version tokens summed over
               DP (``dp_sum``) give the mixture's alpha
    pass       the selected groups not yet scored at t (warmup, scores without pi_t) get theirs;
               every pass's rows go into the cache and are the step's proximal log-probs
               (no pass at all when the variant reads no pi_t: naive async)
    backfill   trainer rows of V(S) the selected samples lack, the own version's included (the
               posterior's, ``backfill.py``): exact from parameter snapshots (``logprobs(batch,
               v)`` for v in ``exact_versions``), else the nearest trainer row
    weights    behavior weights, ratio base and advantages (``PolicyLossInputs``), fixed for the
               whole step, cut into M contiguous mini-batches x epochs

and ``evict(version, stats)`` ends the step. Everything is plain calls with no process group of
its own (``logprobs`` and ``dp_sum`` are given), so it is tested with real ``SampleGroup``s and a
fake trainer. All per-token values are in the packed layout (``sequences.py``), and every batch is
cut from the groups as the buffer packed them on arrival (``BufferEntry.packed``): one
concatenation per pass, one for the mini-batches (views of it), no re-pack of samples.

Order note: scores only need pi_t (the pass) and mu_{v_i} (the engine row), so backfill runs
after selection and only for the selected samples x V(S), not for every candidate. By default
(``replay.rescore=all``, the spec) every candidate is scored at t, in one pass. A group scored
in an earlier step keeps that score (``BufferEntry.score``): scaled by its age it is the
*prediction* the opt-in rules rank old groups by, re-scoring only those predicted to make the
quota (``candidates.py``; not a bound: a group whose score fell can be missed).

The wait before the step (``prefetch``, ``prefetch.py``): while the trainer waits for the step's
groups, the rows the step will need are computed one short pass at a time (log pi_t of the
groups received so far and of the candidates, then snapshot rows of the predicted selection), so
the step's own pass and backfill compute only what the wait did not reach. Every row is computed
once (``rows_duplicate`` counts any that is not) and the step reports where its rows came from.

Samples whose tokens span versions (interruptible rollout): the engine row, each token's log-prob
under the version that sampled it, is stored under the sample's behavior version
``v_i = min(token_versions)`` (``Sample.behavior_version``): it is the exact behavior density the
tokens were drawn from, which is what the score, the own-behavior weight and the k = v_i term of
the mixture need. Such samples are counted (``mixed_version_samples``) and never used for the
engine/trainer mismatch metric.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch

from megatron_darl.algorithms import (
    RATIO_SCORES, PolicyLossInputs, batch_behavior_weights, group_scores,
    needs_logprob_pass, score_tokens,
)
from megatron_darl.step.backfill import backfill, mixture_versions, posterior_reads_trainer
from megatron_darl.step.candidates import audit_rule, extrapolate, rescore
from megatron_darl.step.config import AlgorithmConfig, ReplayConfig
from megatron_darl.step.prefetch import (
    CurrentRows, LogProbFn, RowCounts, Work, entry_pieces, next_work, store_rows, take,
)
from megatron_darl.step.selection import Candidates, Selection
from megatron_darl.step.sequences import (
    pack, packed_batch, response_lengths, sample_index, sequence_batch,
)
from megatron_darl.step.stats import StepStats
from megatron_darl.replay import BufferEntry, LogProbCache, ReplayBuffer, RowSource
from megatron_darl.samples import PackedSamples, Sample, SampleGroup, shard_of, shard_quota
from megatron_darl.trainer.batch import TrainBatch

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # the DP sum (identity with one shard)


@dataclass
class StepPlan:
    """One shard's step, planned: the trainer's mini-batches and what the planner saw.

    On the hub's TP/PP peers (``replica.py``) only ``minibatches`` is set: they hold no samples.
    """

    minibatches: list[TrainBatch]  # M x epochs, one optimizer step each (loss_inputs: PolicyLossInputs)
    selection: Selection | None = None  # the chosen groups
    samples: list[Sample] = field(default_factory=list)  # the trained samples in order (or the filler)
    loss_inputs: PolicyLossInputs | None = None  # (n,) packed over ``samples``: fixed for the step
    filler: bool = False  # nothing selected here: zero-weight stand-ins keep every DP shard in step
    stats: StepStats | None = None  # this shard's statistics so far (``evict`` adds the step's end)


def _filler_sample(version: int) -> Sample:
    """A two-token sample that only ever enters a batch with weight and advantage zero."""
    one = torch.zeros(1, dtype=torch.int64)
    return Sample(sample_id=-1, prompt_ids=one, response_ids=one, behavior_logprobs=torch.zeros(1),
                  token_versions=torch.full((1,), version, dtype=torch.int64))


def _zero_inputs(n: int) -> PolicyLossInputs:
    zero = torch.zeros(n, dtype=torch.float32)
    return PolicyLossInputs(logp_base=zero, weights=zero.clone(), advantages=zero.clone())


def _slice(inputs: PolicyLossInputs, start: int, end: int) -> PolicyLossInputs:
    return PolicyLossInputs(inputs.logp_base[start:end], inputs.weights[start:end],
                            inputs.advantages[start:end])


class ShardPlanner:
    """The algorithm state of one DP shard (its buffer and cache rows) and its step."""

    def __init__(self, algorithm: AlgorithmConfig, replay: ReplayConfig, shard: int = 0,
                 num_shards: int = 1, num_workers: int = 1) -> None:
        """``num_workers``: the run's rollout workers (``RunConfig.topology.workers``), whose
        groups ``shard_of`` deals over the ``num_shards`` DP shards as the channel does."""
        self.quota = shard_quota(algorithm.groups_per_step, num_shards, shard)  # B/DP, or one more
        self.algorithm, self.replay = algorithm, replay
        self.spec = algorithm.spec()
        self.window = replay.window
        self.shard, self.num_shards, self.num_workers = shard, num_shards, num_workers
        self.buffer = ReplayBuffer(self.window, num_shards, replay.warmup, replay.drop_degenerate,
                                   replay.max_replays, algorithm.adv_eps, num_workers)
        self.cache = LogProbCache()
        self.hist_bins = max(replay.k, algorithm.max_staleness + 2)  # last bin: this or older
        self.needs_pass = needs_logprob_pass(self.spec)  # False: no candidate log-prob pass
        self.own_trainer_rows = posterior_reads_trainer(self.spec, algorithm.mis.form)  # ``backfill.py``
        self.logged_nearest_own = False  # mis.backfill=nearest: the own-version copies were logged
        self.current = CurrentRows()  # log pi_t by sample at the trainer's version t
        self.counts = RowCounts()  # rows of the step so far, by where they came from
        self._pending = StepStats.empty(self.hist_bins)  # what the wait before the step did
        self.predicted: tuple[tuple[int, int, int], list[BufferEntry]] | None = None  # the wait's guess

    # ---- the step ---------------------------------------------------------------------------
    def step(self, groups: Sequence[SampleGroup], step: int, version: int, logprobs: LogProbFn,
             exact_versions: Collection[int] = (), dp_sum: AllReduce = lambda t: t,
             lap: Callable[[str], None] = lambda name: None) -> StepPlan:
        """Plan trainer step ``step`` at version ``version`` with this shard's new ``groups``.

        Args:
            logprobs: ``(batch, v) -> (n,)`` packed log-probs of ``batch`` under version v (the
                trainer's pass; v is ``version`` or one of ``exact_versions``).
            exact_versions: versions ``logprobs`` can score besides ``version`` (parameter
                snapshots kept for exact backfill); others are backfilled from the nearest.
            dp_sum: sums a tensor over the DP shards (every shard calls ``step`` once per step).
            lap: called with ``logprob_seconds``, ``plan_seconds``, ``backfill_seconds`` as each
                part ends (``step.StepClock.lap``).
        """
        stats, self._pending = self._pending, StepStats.empty(self.hist_bins)  # the wait's passes
        self.current.at(version)
        self._arrive(groups, step, version, stats)
        proximal: dict[int, torch.Tensor] = {}  # sample_id -> (T_i,) log pi_t: every pass's rows
        passes = lambda entries: self._pass(entries, version, logprobs, proximal, stats)  # noqa: E731
        scores = self._score_candidates(step, version, passes, stats)
        lap("logprob_seconds")
        _score_stats(scores, stats)
        sel = self._select(step, scores, version, stats)
        tokens = dp_sum(sel.version_tokens.clone())
        lap("plan_seconds")
        if self.needs_pass:
            passes([e for e in sel.entries if any(s.sample_id not in proximal for s in e.group.samples)])
        lap("logprob_seconds")
        backfill(self, sel, tokens, step, logprobs, set(exact_versions) | {version}, stats)
        plan = self._plan(sel, tokens, version, proximal, stats, step)
        self._count_rows(stats)
        lap("backfill_seconds")
        return plan

    def evict(self, version: int, stats: StepStats) -> None:
        """Drop groups left of the window at ``version`` with their cache rows; end the step."""
        before = len(self.buffer)
        self._keep_current_rows()
        self.predicted = None
        stats.rows_evicted = float(self.cache.evict(self.buffer.evict(version)))
        stats.groups_evicted = float(before - len(self.buffer))
        stats.buffer_groups, stats.cache_bytes = float(len(self.buffer)), float(self.cache.bytes())
        stats.groups_untrained = float(sum(1 for e in self.buffer.candidates() if e.times_selected == 0))
        for src, n in self.cache.source_counts().items():
            setattr(stats, f"cache_rows_{src}", float(n))

    # ---- arrival and the log-prob pass --------------------------------------------------------
    def _bin(self, staleness: int) -> int:
        return min(max(staleness, 0), self.hist_bins - 1)

    def _arrive(self, groups: Sequence[SampleGroup], step: int, version: int, stats: StepStats) -> None:
        """Buffer the new groups and cache their engine rows; a group already left of the window
        is dropped (counted), a group of another shard raises."""
        for group in groups:
            owner = shard_of(group.group_id, self.num_shards, self.num_workers)
            if owner != self.shard:
                raise ValueError(f"group {group.group_id} belongs to shard {owner}, not {self.shard}")
            stats.groups_received += 1
            stats.samples_received += len(group.samples)
            stats.reward_sum += float(sum(s.reward for s in group.samples))
            stats.response_tokens_received += group.num_tokens
            if group.behavior_version < self.window.oldest(version):
                stats.dropped_stale += 1
                continue
            entry = self.buffer.add(group, step)
            stats.staleness_hist[self._bin(version - entry.behavior_version)] += 1
            for s in group.samples:
                v = s.behavior_version if s.num_tokens else entry.behavior_version
                self.cache.put(s.sample_id, v, s.behavior_logprobs, RowSource.ENGINE)
                if s.num_tokens and int(s.token_versions.max()) != v:
                    stats.mixed_version_samples += 1

    @staticmethod
    def candidates_of(entries: list[BufferEntry], packed: PackedSamples | None = None) -> Candidates:
        """``entries`` as candidates; their engine rows from ``packed`` (their concatenation, when
        a pass made it) or concatenated here."""
        samples = [s for e in entries for s in e.group.samples]
        group_index = torch.tensor([i for i, e in enumerate(entries) for _ in e.group.samples])
        behavior = (packed.behavior_logprobs if packed is not None
                    else torch.cat([e.packed.behavior_logprobs for e in entries]))
        return Candidates(entries, samples, response_lengths(samples), group_index, behavior)

    def _pass(self, entries: list[BufferEntry], version: int, logprobs: LogProbFn,
              proximal: dict[int, torch.Tensor], stats: StepStats) -> Candidates | None:
        """log pi_t of ``entries`` into ``proximal``, into the cache and onto the candidates: the
        rows the wait (``prefetch``) or an earlier pass of this step computed are taken as they
        are, the rest in one pass (none when every row is known)."""
        if not entries:
            return None
        cand = self.candidates_of(entries)
        missing = [s for s in cand.samples if not self.current.has(s)]
        self.counts.reused += sum(1 for s in cand.samples if s.num_tokens) - len(missing)
        if missing:
            work = take(entry_pieces(entries, lambda s: not self.current.has(s)), float("inf"), version)
            self.compute_rows(work, logprobs, stats)
            self.counts.computed += len(work.samples)
            stats.logprob_passes += 1
        rows = [self.current.get(s) for s in cand.samples]
        cand.logp_t = pack(rows)
        for s, row in zip(cand.samples, rows, strict=True):
            proximal[s.sample_id] = row
            if s.num_tokens:  # kept for later steps' backfill (beside an engine row of t)
                self.cache.put(s.sample_id, version, row, RowSource.TRAINER)
        stats.groups_scored += len(entries)
        return cand

    def compute_rows(self, work: Work, logprobs: LogProbFn, stats: StepStats) -> None:
        """One trainer pass over ``work``, its rows stored (``prefetch.store_rows``), plus the
        engine/trainer mismatch (k3 over samples generated at exactly the trainer's version)."""
        logp = logprobs(packed_batch(work.packed), work.version)
        rows, duplicates = store_rows(work.samples, logp, work.version, self.current, self.cache)
        self.counts.duplicate += duplicates
        if work.version != self.current.version:
            return
        for s, row in zip(work.samples, rows, strict=True):
            if bool((s.token_versions == work.version).all()):
                log_r = row.double() - s.behavior_logprobs.double()  # log pi_t - log mu
                stats.mismatch_k3_sum += float((torch.expm1(log_r) - log_r).sum())
                stats.mismatch_tokens += s.num_tokens

    # ---- the wait before a step: rows it will need (``prefetch.py``) ---------------------------
    def prefetch(self, received: Sequence[SampleGroup], step: int, version: int, logprobs: LogProbFn,
                 exact_versions: Collection[int] = (), max_tokens: int = 16384) -> bool:
        """While the trainer waits for step ``step``'s groups (``received``: this shard's so far),
        compute one pass (at most ``max_tokens`` tokens) of the rows the step will need; False
        when nothing is left to do (or the variant reads no pi_t)."""
        if not self.needs_pass:
            return False
        self.current.at(version)
        work = next_work(self, received, step, version, set(exact_versions), max_tokens)
        if work is None:
            return False
        self.compute_rows(work, logprobs, self._pending)
        self.counts.prefetched += len(work.samples)
        self._pending.prefetch_passes += 1
        return True

    def dropped_degenerate(self, groups: Sequence[SampleGroup]) -> None:
        """Count the groups of equal rewards the hub dropped while the step waited
        (``replay.fill_batch``): in the step's statistics, never in the buffer."""
        stats = self._pending
        for group in groups:
            stats.groups_degenerate += 1
            stats.samples_degenerate += len(group.samples)
            stats.reward_sum_degenerate += float(sum(s.reward for s in group.samples))
            stats.response_tokens_degenerate += group.num_tokens

    def _keep_current_rows(self) -> None:
        """The step made a new version: its rows at the old one go into the cache for the
        buffered samples (a later backfill of that version reads them), then are dropped."""
        version = self.current.version
        for e in self.buffer.entries(self.shard):
            for s in e.group.samples:
                if s.num_tokens and self.current.has(s):
                    self.cache.put(s.sample_id, version, self.current.get(s), RowSource.TRAINER)
        self.current.clear()

    def _count_rows(self, stats: StepStats) -> None:
        """The step's rows by where they came from, into ``stats``; the counts start again."""
        c, self.counts = self.counts, RowCounts()
        stats.rows_computed, stats.rows_prefetched = float(c.computed), float(c.prefetched)
        stats.rows_reused, stats.rows_duplicate = float(c.reused), float(c.duplicate)

    def _score_candidates(self, step: int, version: int,
                          passes: Callable[[list[BufferEntry]], Candidates | None],
                          stats: StepStats) -> dict[int, float]:
        """group_id -> score at t of the groups that may be selected (none during warmup).

        Scores that read no pi_t score every candidate from the engine rows; ratio scores run
        ``passes`` over the groups ``replay.rescore`` asks for and remember each score."""
        entries = self.buffer.candidates(self.shard)
        stats.candidate_groups = float(len(entries))
        if not entries or self.buffer.in_warmup(step):
            return {}
        if self.spec.score not in RATIO_SCORES:
            return self.score(self.candidates_of(entries), step)

        def score(ids: list[int]) -> dict[int, float]:
            chosen = [self.buffer.entry(gid) for gid in ids]
            out = self.score(passes(chosen), step)
            for e in chosen:
                e.score, e.scored_version = out[e.group_id], version
            return out

        fresh = [e.group_id for e in entries if e.score is None]
        predicted = {e.group_id: extrapolate(float(e.score), e.behavior_version, e.scored_version,
                                             version) for e in entries if e.score is not None}
        prior = [(e.group_id, predicted[e.group_id]) for e in sorted(
            (e for e in entries if e.score is not None),
            key=lambda e: (predicted[e.group_id], -e.behavior_version, -e.arrival_seq))]
        rank = lambda sc: [e.group_id for e in self.buffer.rank(step, self.quota, sc, [self.shard])]  # noqa: E731
        if not self.replay.rescore_audit:
            return rescore(self.replay.rescore, fresh, prior, self.quota, score, rank).scores
        scores = score([e.group_id for e in entries])
        audit = audit_rule(self.replay.rescore, fresh, prior, self.quota, scores, rank)
        stats.rescore_audits += 1
        stats.rescore_agreement_sum += audit.agreement
        stats.rescore_score_gap_sum += audit.score_gap
        stats.rescore_rule_scored += audit.scored
        return scores

    # ---- score and selection ----------------------------------------------------------------
    def score(self, cand: Candidates, step: int) -> dict[int, float]:
        """group_id -> score (lower is selected first) with the variant's score kind."""
        lb = cand.behavior  # (n,)
        lc = lb  # read only by the ratio scores, which need the pass
        if self.spec.score in RATIO_SCORES:
            assert cand.logp_t is not None, "a ratio score needs the candidates' log-prob pass"
            lc = cand.logp_t.to(torch.float32)  # (n,) the pass's rows: the proximal rows
        bv = torch.tensor([e.behavior_version for e in cand.entries])[cand.group_index]  # (N,)
        gen = self._generator(step)
        n = len(cand.samples)
        s = score_tokens(self.spec.score, lc, lb, sample_index(cand.lengths), n, bv, gen)  # (N,)
        g = group_scores(s, cand.lengths, cand.group_index, len(cand.entries))  # (M,)
        return {e.group_id: float(g[i]) for i, e in enumerate(cand.entries)}

    def _generator(self, step: int, stream: int = 0) -> torch.Generator:
        """Seeded per (``algorithm.seed``, step, shard, stream): the same in a rerun and a resume."""
        return torch.Generator().manual_seed(
            (self.algorithm.seed * 1_000_003 + step * 7919 + self.shard + stream * 104_729) % (1 << 63))

    def _select(self, step: int, scores: dict[int, float], version: int, stats: StepStats) -> Selection:
        """The shard's quota, its per-version tokens and the selection statistics."""
        entries = self.buffer.select(step, self.quota, scores, shards=[self.shard])
        versions = self.window.versions(version)
        tokens = torch.zeros(len(versions), dtype=torch.float64)
        for e in entries:
            for s in e.group.samples:
                if s.num_tokens:
                    tokens[versions.index(s.behavior_version)] += s.num_tokens
        chosen = [0.0 if self.buffer.in_warmup(step) else float(scores[e.group_id]) for e in entries]
        sel = Selection(entries, versions, tokens, chosen)
        for e in entries:
            stats.selected_hist[self._bin(version - e.behavior_version)] += 1
        stats.groups_selected, stats.samples_selected = float(len(entries)), float(len(sel.samples))
        stats.tokens_selected, stats.selected_score_sum = float(tokens.sum()), float(sum(chosen))
        stats.selected_staleness_max = float(max((version - e.behavior_version for e in entries), default=-1))
        stats.times_selected_max = float(max((e.times_selected for e in entries), default=0))
        return sel

    # ---- loss inputs and mini-batches -----------------------------------------------------------
    def _plan(self, sel: Selection, global_tokens: torch.Tensor, version: int,
              proximal: dict[int, torch.Tensor], stats: StepStats, step: int = 0) -> StepPlan:
        """Behavior weights, ratio base and advantages fixed once for the whole step
        (docs/algorithm.md, PPO mini-batches), cut into M contiguous mini-batches x epochs of the
        selected groups in a seeded random order (in selection order the stalest groups would always
        train last). With nothing selected on this shard (e.g. step 0 when the hash sent every group
        elsewhere) the step trains a zero-weight stand-in, so every DP shard takes the same
        optimizer steps."""
        if len(sel.entries) > 1 and self.algorithm.ppo_minibatches > 1:
            order = torch.randperm(len(sel.entries), generator=self._generator(step, stream=1)).tolist()
            sel = dataclasses.replace(sel, entries=[sel.entries[i] for i in order],
                                      scores=[sel.scores[i] for i in order])
        if not sel.entries:
            samples = [_filler_sample(version)]
            inputs = _zero_inputs(samples[0].num_tokens)
        else:
            samples = sel.samples
            inputs = self._loss_inputs(sel, global_tokens, version, proximal, stats)
        parts = self._minibatches(sel.entries, samples, inputs, version)
        return StepPlan(parts * self.algorithm.ppo_epochs, sel, samples, inputs, not sel.entries, stats)

    def _loss_inputs(self, sel: Selection, global_tokens: torch.Tensor, version: int,
                     proximal: dict[int, torch.Tensor], stats: StepStats) -> PolicyLossInputs:
        samples = sel.samples
        lengths = response_lengths(samples)  # (N,)
        bv = torch.tensor([s.behavior_version if s.num_tokens else e.behavior_version
                           for e in sel.entries for s in e.group.samples])  # (N,)
        ids = [s.sample_id for s in samples]
        by_version = self.cache.gather(ids, sel.versions)  # (K, n) the engine's at k = v_i
        posterior = None  # the trainer's rows of every version, own included (``backfill.py``)
        if self.own_trainer_rows and len(mixture_versions(sel, global_tokens)) > 1:
            posterior = self.cache.gather(ids, sel.versions, trainer=True)  # (K, n)
        n = int(lengths.sum())
        if self.needs_pass:
            missing = [s.sample_id for s in samples if s.sample_id not in proximal]
            if missing:
                raise ValueError(f"samples {missing[:5]} were not in the log-prob pass at version {version}")
            logp_t = pack([proximal[s.sample_id] for s in samples])  # (n,)
        else:  # naive async: no pi_t anywhere; the shape is all batch_behavior_weights reads
            logp_t = torch.zeros(n, dtype=torch.float32)
        bw = batch_behavior_weights(
            self.spec, logp_t, by_version, torch.tensor(sel.versions),
            torch.repeat_interleave(bv, lengths), torch.ones(n, dtype=torch.bool),
            clip=self.algorithm.weight_cap, version_tokens=global_tokens,
            cap_mode=self.algorithm.mis.cap_mode, form=self.algorithm.mis.form,
            sample_index=sample_index(lengths), posterior_by_version=posterior,
        )
        adv = torch.cat([e.advantages for e in sel.entries]).float()  # (N,)
        w = bw.weights.double()
        stats.w_sum, stats.w_sq_sum = float(w.sum()), float(w.square().sum())
        stats.w_tokens, stats.w_clipped = float(n), float(bw.capped.sum())
        adv_t = torch.repeat_interleave(adv, lengths)  # (n,)
        for sign, on in (("pos", adv_t > 0), ("neg", adv_t < 0)):
            setattr(stats, f"w_{sign}_sum", float(w[on].sum()))
            setattr(stats, f"w_{sign}_tokens", float(on.sum()))
            setattr(stats, f"w_{sign}_clipped", float(bw.capped[on].sum()))
        return PolicyLossInputs(logp_base=bw.logp_base.float(), weights=bw.weights.float(),
                                advantages=adv_t)

    def _minibatches(self, entries: list[BufferEntry], samples: list[Sample], inputs: PolicyLossInputs,
                     version: int) -> list[TrainBatch]:
        """M contiguous parts of the samples (sizes differ by at most one), each a view of the
        entries' packed groups end to end (one copy) and a contiguous slice of the packed inputs;
        a zero-weight one-token stand-in where a part is empty (or nothing is selected)."""
        packed = PackedSamples.concat([e.packed for e in entries], rows=False) if entries else None
        ends = torch.cumsum(response_lengths(samples), 0).tolist()
        out = []
        for idx in torch.arange(len(samples)).tensor_split(self.algorithm.ppo_minibatches):
            if packed is None or idx.numel() == 0:  # one scored token: adds 1 to the step's token count
                stand_in = _filler_sample(version)
                out.append(sequence_batch([stand_in], _zero_inputs(stand_in.num_tokens)))
                continue
            first, last = int(idx[0]), int(idx[-1])
            start = ends[first - 1] if first else 0
            out.append(packed_batch(packed.slice(first, last + 1), _slice(inputs, start, ends[last])))
        return out

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.buffer.state_dict(), "cache": self.cache.state_dict(),
                "shard": self.shard, "num_shards": self.num_shards}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_shards"]) != self.num_shards or int(state["shard"]) != self.shard:
            raise ValueError(
                f"replay state of shard {state['shard']}/{state['num_shards']} cannot load into "
                f"shard {self.shard}/{self.num_shards}"
            )
        self.buffer.load_state_dict(state["buffer"])
        self.cache.load_state_dict(state["cache"])


def _score_stats(scores: dict[int, float], stats: StepStats) -> None:
    """Sum, count and max of the candidate group scores."""
    values = [float(v) for v in scores.values()]
    stats.score_sum, stats.score_count = sum(values), float(len(values))
    stats.score_max = max(values) if values else float("-inf")
