"""One DP shard's D-ARL step logic over the replay buffer, the log-prob cache and the algorithms.

The trainer loop (``trainer_loop.py``) owns processes, the trainer and the transport; everything
the algorithm decides per step lives here, as plain calls that need no process group, so it can
be tested with real ``SampleGroup``s and random tensors:

    receive(groups)                 buffer the shard's new groups; engine rows into the cache
    candidate_batch()               TrainBatch over every selectable group (the log-prob pass)
    store_logprobs(cand, logp, t)   trainer rows (version t) into the cache, kept as proximal
                                    (skipped when ``needs_pass`` is False: naive async)
    score(cand, step)               per-group scores (the variant's score kind)
    select(step, scores)            the shard's quota B/DP (warmup: freshest first)
    mixture_versions(tokens)        V(S) from the DP-summed per-version token counts
    missing_rows / backfill_batch / store_backfill / backfill_nearest
    training_batch(sel, tokens, t)  the PPO mini-batches (M x epochs TrainBatches) with weights,
                                    ratio base and advantages fixed for the whole step
    evict(version)                  drop groups left of the window, with their cache rows

Order note: scores only need pi_t (the pass) and mu_{v_i} (the engine row), so backfill runs
after selection and only for the selected samples x V(S), not for every candidate.

Samples whose tokens span versions (interruptible rollout): the engine row, each token's log-prob
under the version that sampled it, is stored under the sample's behavior version
``v_i = min(token_versions)`` (``Sample.behavior_version``): it is the exact behavior density the
tokens were drawn from, which is what the score, the own-behavior weight and the k = v_i term of
the mixture need. Such samples are counted (``mixed_version_samples``) and never used for the
engine/trainer mismatch metric.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from megatron_darl.algorithms import (
    RATIO_SCORES, WeightRule, batch_behavior_weights, group_scores, needs_logprob_pass,
    policy_loss, score_samples,
)
from megatron_darl.loop.config import AlgorithmConfig, ReplayConfig
from megatron_darl.loop.sequences import pad_rows, response_mask, response_rows, sequence_batch
from megatron_darl.replay import BufferEntry, LogProbCache, ReplayBuffer, RowSource, shard_of
from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.trainer.batch import TrainBatch

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # in-place or returning the DP sum


@dataclass
class CandidateBatch:
    """The log-prob pass input and how its rows map back to samples and groups."""

    batch: TrainBatch  # prompt ++ response per sample, scored on the response
    entries: list[BufferEntry]  # candidate groups in batch order
    samples: list[Sample]  # flattened samples of ``entries``
    group_index: torch.Tensor  # (N,) int64 position of each sample's group in ``entries``


@dataclass
class Selection:
    """What ``select`` chose on this shard and the per-version token counts to all-reduce."""

    entries: list[BufferEntry]  # chosen groups, best first
    versions: list[int]  # the window [t - K + 1, t] (same on every shard), ascending
    version_tokens: torch.Tensor  # (K,) float64 selected response tokens per window version
    scores: list[float]  # score of each chosen group (0.0 during warmup)

    @property
    def samples(self) -> list[Sample]:
        return [s for e in self.entries for s in e.group.samples]


@dataclass
class TrainingBatch:
    """The train step's input plus the step's weight statistics (sums, for DP reduction)."""

    batch: TrainBatch  # the whole selection; token_fields: weights, logp_base; seq_fields: advantages
    filler: bool  # True when nothing was selectable: one zero-weight sample keeps DP in step
    sums: dict[str, float] = field(default_factory=dict)  # w_sum, w_sq_sum, w_tokens, w_clipped
    minibatches: list[TrainBatch] = field(default_factory=list)  # M x epochs, one optimizer step each


def loss_fn_for(eps_low: float, eps_high: float):
    """The trainer's ``loss_fn(logp (n,), batch_slice) -> (loss_sum, stats)`` around ``policy_loss``.

    Each scored token is one row of ``policy_loss`` (its advantage repeated per token), so the
    token mean times n is the micro-batch's loss sum; the trainer divides by the step's tokens.
    """
    def loss_fn(logp: torch.Tensor, batch_slice: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        n = int(logp.shape[0])
        dev = logp.device
        base = batch_slice.masked("logp_base").to(dev)[:, None]  # (n, 1)
        weights = batch_slice.masked("weights").to(dev)[:, None]  # (n, 1)
        adv = batch_slice.per_token("advantages").to(dev)  # (n,)
        mask = torch.ones(n, 1, dtype=torch.bool, device=dev)
        loss, stats = policy_loss(logp[:, None], base, weights, adv, mask, eps_low, eps_high)
        keep = ("clip_frac_low", "clip_frac_high", "mean_ratio", "mean_weight")
        return loss * n, {k: float(getattr(stats, k)) for k in keep}

    return loss_fn


def _filler_sample(version: int) -> Sample:
    """A two-token sample that only ever enters a batch with weight and advantage zero."""
    one = torch.zeros(1, dtype=torch.int64)
    return Sample(sample_id=-1, prompt_ids=one, response_ids=one, behavior_logprobs=torch.zeros(1),
                  token_versions=torch.full((1,), version, dtype=torch.int64))


class ShardPlanner:
    """The algorithm state of one DP shard: its buffer, its cache rows, this step's proximal rows."""

    def __init__(self, algorithm: AlgorithmConfig, replay: ReplayConfig, shard: int = 0,
                 num_shards: int = 1) -> None:
        if algorithm.groups_per_step % num_shards:
            raise ValueError(
                f"algorithm.groups_per_step={algorithm.groups_per_step} must be a multiple of "
                f"the DP size {num_shards} (each shard selects B/DP groups)"
            )
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} outside 0..{num_shards - 1}")
        self.algorithm, self.replay = algorithm, replay
        self.spec = algorithm.spec()
        self.shard, self.num_shards = shard, num_shards
        self.quota = algorithm.groups_per_step // num_shards
        self.buffer = ReplayBuffer(replay.k, num_shards, replay.warmup, replay.drop_degenerate,
                                   replay.max_replays, algorithm.adv_eps)
        self.cache = LogProbCache()
        self.hist_bins = max(replay.k, algorithm.max_staleness + 2)  # last bin: this or older
        self.needs_pass = needs_logprob_pass(self.spec)  # False: no candidate log-prob pass
        self._proximal: dict[int, torch.Tensor] = {}  # sample_id -> (T,) trainer log pi_t
        self._proximal_version = -1

    # ---- versions ---------------------------------------------------------------------------
    def window(self, version: int) -> list[int]:
        """Behavior versions kept at trainer version t: ``[max(0, t - K + 1), t]``."""
        return list(range(max(0, version - self.replay.k + 1), version + 1))

    def _bin(self, staleness: int) -> int:
        return min(max(staleness, 0), self.hist_bins - 1)

    # ---- arrival ----------------------------------------------------------------------------
    def receive(self, groups: Sequence[SampleGroup], step: int, version: int) -> dict[str, Any]:
        """Buffer this shard's new groups and cache their engine log-probs (source ``engine``).

        Groups whose behavior version is already left of the window are dropped (counted), a
        group of another shard raises. Returns the arrival sums of the step's metrics.
        """
        hist = torch.zeros(self.hist_bins, dtype=torch.float64)
        sums = {"groups_received": 0.0, "samples_received": 0.0, "reward_sum": 0.0,
                "response_tokens_received": 0.0, "dropped_stale": 0.0, "mixed_version_samples": 0.0}
        oldest = self.window(version)[0]
        for group in groups:
            owner = shard_of(group.group_id, self.num_shards)
            if owner != self.shard:
                raise ValueError(f"group {group.group_id} belongs to shard {owner}, not {self.shard}")
            sums["groups_received"] += 1
            sums["samples_received"] += len(group.samples)
            sums["reward_sum"] += float(sum(s.reward for s in group.samples))
            sums["response_tokens_received"] += group.num_tokens
            if group.behavior_version < oldest:
                sums["dropped_stale"] += 1
                continue
            entry = self.buffer.add(group, step)
            hist[self._bin(version - entry.behavior_version)] += 1
            for s in group.samples:
                v = s.behavior_version if s.num_tokens else entry.behavior_version
                self.cache.put(s.sample_id, v, s.behavior_logprobs, RowSource.ENGINE)
                if s.num_tokens and int(s.token_versions.max()) != v:
                    sums["mixed_version_samples"] += 1
        return {**sums, "staleness_hist": hist}

    # ---- log-prob pass ----------------------------------------------------------------------
    def candidate_batch(self) -> CandidateBatch | None:
        """Every selectable group of this shard as one batch for the trainer's log-prob pass."""
        entries = self.buffer.candidates(self.shard)
        if not entries:
            return None
        samples = [s for e in entries for s in e.group.samples]
        group_index = torch.tensor([i for i, e in enumerate(entries) for _ in e.group.samples])
        return CandidateBatch(sequence_batch(samples), entries, samples, group_index)

    def store_logprobs(self, cand: CandidateBatch, logp: torch.Tensor, version: int) -> dict[str, float]:
        """Take the pass's ``(T,)`` log-probs (version t) into the cache and as proximal rows.

        Returns mismatch sums: the k3 estimate of KL(engine || trainer) over tokens of samples
        that the engine generated at exactly this version.
        """
        self._proximal, self._proximal_version = {}, version
        k3_sum, k3_tokens = 0.0, 0.0
        for s, row in zip(cand.samples, response_rows(cand.batch, cand.samples, logp), strict=True):
            self._proximal[s.sample_id] = row
            self.cache.put(s.sample_id, version, row, RowSource.TRAINER)
            if s.num_tokens and bool((s.token_versions == version).all()):
                log_r = (row.double() - s.behavior_logprobs.double())  # log pi_t - log mu
                k3_sum += float((torch.expm1(log_r) - log_r).sum())
                k3_tokens += s.num_tokens
        return {"mismatch_k3_sum": k3_sum, "mismatch_tokens": k3_tokens}

    def _proximal_rows(self, samples: Sequence[Sample], version: int) -> list[torch.Tensor]:
        if version != self._proximal_version:
            raise ValueError(f"no log-prob pass at version {version} (last: {self._proximal_version})")
        missing = [s.sample_id for s in samples if s.sample_id not in self._proximal]
        if missing:
            raise ValueError(f"samples {missing[:5]} were not in this step's log-prob pass")
        return [self._proximal[s.sample_id] for s in samples]

    # ---- score and selection ----------------------------------------------------------------
    def score(self, cand: CandidateBatch, step: int) -> dict[int, float]:
        """group_id -> score (lower is selected first) with the variant's score kind."""
        samples = cand.samples
        mask = response_mask(samples)  # (N, T)
        t_max = mask.shape[1]
        lb = pad_rows([s.behavior_logprobs for s in samples], t_max)  # (N, T)
        lc = lb  # read only by the ratio scores, which need the pass
        if self.spec.score in RATIO_SCORES:
            lc = pad_rows(self._proximal_rows(samples, self._proximal_version), t_max)  # (N, T)
        bv = torch.tensor([e.behavior_version for e in cand.entries])[cand.group_index]  # (N,)
        gen = torch.Generator().manual_seed(
            (self.algorithm.seed * 1_000_003 + step * 7919 + self.shard) % (1 << 63))
        s = score_samples(self.spec.score, lc, lb, mask, bv, gen)  # (N,)
        g = group_scores(s, mask.sum(dim=1), cand.group_index, len(cand.entries))  # (M,)
        return {e.group_id: float(g[i]) for i, e in enumerate(cand.entries)}

    def select(self, step: int, scores: dict[int, float], version: int) -> Selection:
        """Choose the shard's quota and count per-version selected tokens (all-reduce those)."""
        entries = self.buffer.select(step, self.quota, scores, shards=[self.shard])
        versions = self.window(version)
        tokens = torch.zeros(len(versions), dtype=torch.float64)
        for e in entries:
            for s in e.group.samples:
                if s.num_tokens:
                    tokens[versions.index(s.behavior_version)] += s.num_tokens
        chosen = [0.0 if self.buffer.in_warmup(step) else float(scores[e.group_id]) for e in entries]
        return Selection(entries, versions, tokens, chosen)

    def selection_sums(self, sel: Selection, version: int) -> dict[str, Any]:
        """Selected groups/tokens, score sum and the selected-staleness histogram (t - v_i)."""
        hist = torch.zeros(self.hist_bins, dtype=torch.float64)
        for e in sel.entries:
            hist[self._bin(version - e.behavior_version)] += 1
        return {"groups_selected": float(len(sel.entries)),
                "samples_selected": float(len(sel.samples)),
                "tokens_selected": float(sel.version_tokens.sum()),
                "selected_score_sum": float(sum(sel.scores)), "selected_hist": hist,
                # t - oldest selected behavior version (-1: nothing selected), reduced by max
                "selected_staleness_max": float(max((version - e.behavior_version
                                                     for e in sel.entries), default=-1)),
                # after this selection: a group trained more often than max_replays shows here
                "times_selected_max": float(max((e.times_selected for e in sel.entries), default=0))}

    # ---- backfill -----------------------------------------------------------------------------
    def mixture_versions(self, sel: Selection, global_tokens: torch.Tensor) -> list[int]:
        """V(S): window versions with selected tokens on any shard, when the rule is a mixture."""
        if self.spec.weight_rule is not WeightRule.MIXTURE:
            return []
        return [v for v, n in zip(sel.versions, global_tokens.tolist()) if n > 0]

    def missing_rows(self, sel: Selection, versions: Sequence[int]) -> list[tuple[int, int]]:
        """(sample_id, version) rows the mixture needs and the cache lacks."""
        return self.cache.missing([s.sample_id for s in sel.samples if s.num_tokens], versions)

    def backfill_batch(self, sel: Selection, version: int) -> tuple[TrainBatch, list[Sample]] | None:
        """Batch of the selected samples lacking a row for ``version`` (for a snapshot pass)."""
        todo = [s for s in sel.samples if s.num_tokens and (s.sample_id, version) not in self.cache]
        return (sequence_batch(todo), todo) if todo else None

    def store_backfill(self, batch: TrainBatch, samples: Sequence[Sample], logp: torch.Tensor,
                       version: int) -> int:
        """Cache a snapshot pass's ``(T,)`` log-probs under ``version`` (source ``snapshot``)."""
        rows = response_rows(batch, samples, logp)
        return sum(self.cache.put(s.sample_id, version, r, RowSource.SNAPSHOT)
                   for s, r in zip(samples, rows, strict=True))

    def backfill_nearest(self, sel: Selection, versions: Sequence[int]) -> int:
        """Approximate missing rows by the nearest exact version (``mis.backfill=nearest``)."""
        return self.cache.backfill_nearest([s.sample_id for s in sel.samples if s.num_tokens], versions)

    # ---- training batch and eviction -----------------------------------------------------------
    def training_batch(self, sel: Selection, global_tokens: torch.Tensor, version: int) -> TrainingBatch:
        """The train step's PPO mini-batches: behavior weights, ratio base and advantages fixed
        once for the whole step (DESIGN 4.6), the selection cut into M contiguous parts.

        With nothing selected on this shard, or fewer samples than mini-batches, a part is a
        two-token zero-weight stand-in (``batch`` then holds a buffered sample, or the stand-in
        when the buffer is empty, as at step 0 when the hash split sent every group to other
        shards): every DP shard takes the same M x epochs optimizer steps, with zero loss where
        it has nothing.
        """
        filler = not sel.entries
        if filler:  # zero weight and advantage: no loss, no gradient, no log-prob pass needed
            samples = [self._filler(version)]
            adv, mask = torch.zeros(1), response_mask(samples)
            weights = base = torch.zeros(mask.shape, dtype=torch.float32)
            capped = torch.zeros(mask.shape, dtype=torch.bool)
        else:
            samples = sel.samples
            adv = torch.cat([e.advantages for e in sel.entries]).float()  # (N,)
            mask = response_mask(samples)  # (N, T)
            weights, base, capped = self._weights(sel, mask, global_tokens, version)
        rows = {"weights": weights, "logp_base": base}
        w = weights[mask].double()
        sums = {"w_sum": float(w.sum()), "w_sq_sum": float(w.square().sum()),
                "w_tokens": float(mask.sum()) if not filler else 0.0,
                "w_clipped": float(capped[mask].sum())}
        parts = self._minibatches(samples, rows, adv, filler, version)
        batch = sequence_batch(samples, rows, {"advantages": adv})
        return TrainingBatch(batch, filler, sums, parts * self.algorithm.ppo_epochs)

    def _filler(self, version: int) -> Sample:
        pool = [s for e in self.buffer.entries(self.shard) for s in e.group.samples if s.num_tokens]
        return max(pool, key=lambda s: s.sample_id) if pool else _filler_sample(version)

    def _minibatches(self, samples, rows, adv, filler: bool, version: int) -> list[TrainBatch]:
        """M contiguous parts of the samples (sizes differ by at most one), fillers where empty."""
        out = []
        for idx in torch.arange(len(samples)).tensor_split(self.algorithm.ppo_minibatches):
            if filler or idx.numel() == 0:  # one scored token: adds 1 to the step's token count
                s = [_filler_sample(version)]
                zero = torch.zeros(response_mask(s).shape, dtype=torch.float32)
                out.append(sequence_batch(s, {"weights": zero, "logp_base": zero},
                                          {"advantages": torch.zeros(1)}))
            else:
                part = [samples[i] for i in idx.tolist()]
                out.append(sequence_batch(part, {k: v[idx] for k, v in rows.items()},
                                          {"advantages": adv[idx]}))
        return out

    def _weights(self, sel: Selection, mask, global_tokens, version: int):
        """(weights, ratio base, capped), each (N, T), from ``batch_behavior_weights``."""
        samples = sel.samples
        bv = torch.tensor([s.behavior_version if s.num_tokens else e.behavior_version
                           for e in sel.entries for s in e.group.samples])  # (N,)
        by_version = self.cache.gather([s.sample_id for s in samples], sel.versions,
                                       t_max=mask.shape[1])  # (K, N, T)
        if self.needs_pass:
            logp_t = pad_rows(self._proximal_rows(samples, version), mask.shape[1])  # (N, T)
        else:  # naive async: no pi_t anywhere; the shape is all batch_behavior_weights reads
            logp_t = torch.zeros(mask.shape, dtype=torch.float32)
        bw = batch_behavior_weights(
            self.spec, logp_t, by_version, torch.tensor(sel.versions), bv, mask,
            clip=self.algorithm.weight_cap, version_tokens=global_tokens,
            cap_mode=self.algorithm.mis.cap_mode,
        )
        return bw.weights, bw.logp_base, bw.capped

    def evict(self, version: int) -> dict[str, float]:
        """Drop groups left of the window at ``version`` and their cache rows; end the step."""
        before = len(self.buffer)
        rows = self.cache.evict(self.buffer.evict(version))
        self._proximal, self._proximal_version = {}, -1
        held = {f"cache_rows_{src}": float(n) for src, n in self.cache.source_counts().items()}
        return {"groups_evicted": float(before - len(self.buffer)), "rows_evicted": float(rows),
                "buffer_groups": float(len(self.buffer)), "cache_bytes": float(self.cache.bytes()),
                **held}

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
