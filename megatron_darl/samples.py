"""Typed records that cross component boundaries: one generated ``Sample`` and its ``SampleGroup``.

They live in their own module because rollout produces them, transport frames them, replay stores
them and the loop consumes them, and none of those may import the others (docs/architecture.md,
Layers and imports). ``shard_of`` is here for the same reason: the sample channel routes a group to
the DP hub that the replay buffer files it under, and both must agree. ``PackedSamples`` is a
group's samples in the trainer's token layout, made once when the replay buffer takes the group
and read by the step (``step/sequences.py``). The module imports nothing of ours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class Sample:
    """One response to one prompt, exactly as the rollout engine produced it."""

    sample_id: int  # globally unique id of this response
    prompt_ids: torch.Tensor  # (P,) int64 prompt token ids (chat template applied)
    response_ids: torch.Tensor  # (T,) int64 generated token ids
    behavior_logprobs: torch.Tensor  # (T,) float32 engine log-prob of each sampled token
    token_versions: torch.Tensor  # (T,) int64 weight version that produced each token
    reward: float = 0.0  # scalar reward from the task's verifier
    truncated: bool = False  # True when generation stopped at the length limit

    def __post_init__(self) -> None:
        n = self.response_ids.shape[0]
        if self.response_ids.dim() != 1 or self.prompt_ids.dim() != 1:
            raise ValueError(f"sample {self.sample_id}: prompt_ids/response_ids must be 1-D")
        if self.behavior_logprobs.shape != (n,) or self.token_versions.shape != (n,):
            raise ValueError(
                f"sample {self.sample_id}: behavior_logprobs {tuple(self.behavior_logprobs.shape)} "
                f"and token_versions {tuple(self.token_versions.shape)} must both be ({n},)"
            )

    @property
    def num_tokens(self) -> int:
        """Response length T (the tokens the loss is taken over)."""
        return int(self.response_ids.shape[0])

    @property
    def behavior_version(self) -> int:
        """Version of the oldest token: the sample's behavior policy (docs/architecture.md)."""
        if self.num_tokens == 0:
            return -1
        return int(self.token_versions.min())


@dataclass
class SampleGroup:
    """The G responses to one prompt: the unit of advantage normalisation, replay and selection."""

    group_id: int  # globally unique id (rollout worker id folded in)
    prompt_id: int  # id of the prompt in the prompt source
    samples: list[Sample] = field(default_factory=list)
    worker_id: int = -1  # rollout worker that generated the group
    worker_index: int = -1  # 0-based ordinal among its worker's groups in the run (restarts continue it)

    @property
    def behavior_version(self) -> int:
        """Oldest behavior version among the group's samples."""
        versions = [s.behavior_version for s in self.samples if s.num_tokens > 0]
        return min(versions) if versions else -1

    @property
    def rewards(self) -> torch.Tensor:
        """(G,) float32 rewards of the group's samples."""
        return torch.tensor([s.reward for s in self.samples], dtype=torch.float32)

    @property
    def num_tokens(self) -> int:
        """Total response tokens in the group."""
        return sum(s.num_tokens for s in self.samples)


@dataclass
class PackedSamples:
    """Samples end to end in the trainer's layout: each sequence is ``prompt ++ response``, scored
    (``loss_mask``) on its response tokens, and the engine log-probs are in the packed scored layout
    (``step/sequences.py``).

    The replay buffer packs a group once, on arrival (``pack_samples``); a step's batches are then
    one concatenation of such pieces (``concat``) or views of one (``slice``), never a re-pack of
    the samples. Read-only: the pieces share storage with the buffer and with each other.
    """

    input_ids: torch.Tensor  # (L,) int64 prompt ++ response token ids of each sample, end to end
    seq_lens: torch.Tensor  # (N,) int64 prompt + response tokens of each sample; sums to L
    loss_mask: torch.Tensor  # (L,) bool True at the response tokens (never a sequence's first)
    lengths: torch.Tensor  # (N,) int64 response tokens of each sample: the scored layout's segments
    behavior_logprobs: torch.Tensor | None  # (n,) float32 engine log-probs, n = lengths.sum()
    # (None in a concatenation made for its tokens only)

    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.shape[0])

    def slice(self, first: int, end: int) -> "PackedSamples":
        """Samples ``first .. end - 1`` as views (no copy)."""
        seq = [0, *torch.cumsum(self.seq_lens, 0).tolist()]
        scored = [0, *torch.cumsum(self.lengths, 0).tolist()]
        a, b = seq[first], seq[end]
        rows = self.behavior_logprobs
        return PackedSamples(self.input_ids[a:b], self.seq_lens[first:end], self.loss_mask[a:b],
                             self.lengths[first:end], None if rows is None else rows[scored[first]:scored[end]])

    @staticmethod
    def concat(parts: Sequence["PackedSamples"], rows: bool = True) -> "PackedSamples":
        """``parts`` end to end: one copy of each field (none for a single part); with ``rows``
        False the engine log-probs are left out (a batch for the trainer needs only the tokens)."""
        if not parts:
            raise ValueError("cannot concatenate zero PackedSamples")
        if len(parts) == 1:
            return parts[0] if rows else dataclasses.replace(parts[0], behavior_logprobs=None)
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        return PackedSamples(cat("input_ids"), cat("seq_lens"), cat("loss_mask"), cat("lengths"),
                             cat("behavior_logprobs") if rows else None)


def pack_samples(samples: Sequence[Sample]) -> PackedSamples:
    """Pack ``samples`` (one copy of their token ids and engine log-probs).

    A sample needs a prompt token: the trainer never scores a sequence's first token
    (``trainer/batch.py``), so an empty prompt would lose the first response token; it is refused
    by sample id.
    """
    if not samples:
        raise ValueError("cannot pack zero samples")
    for s in samples:
        if s.prompt_ids.shape[0] < 1:
            raise ValueError(
                f"sample {s.sample_id} has an empty prompt: the trainer never scores a "
                "sequence's first token, so the first response token would be lost"
            )
    prompts = torch.tensor([s.prompt_ids.shape[0] for s in samples], dtype=torch.int64)  # (N,)
    lengths = torch.tensor([s.num_tokens for s in samples], dtype=torch.int64)  # (N,)
    seq_lens = prompts + lengths  # (N,)
    starts = torch.repeat_interleave(torch.cumsum(seq_lens, 0) - seq_lens, seq_lens)  # (L,)
    position = torch.arange(int(seq_lens.sum())) - starts  # (L,) position inside its sequence
    loss_mask = position >= torch.repeat_interleave(prompts, seq_lens)  # (L,) the response tokens
    ids = torch.cat([t.long() for s in samples for t in (s.prompt_ids, s.response_ids)])
    behavior = torch.cat([s.behavior_logprobs.to(torch.float32) for s in samples])
    return PackedSamples(ids, seq_lens, loss_mask, lengths, behavior)


def share_packed(samples: Sequence[Sample], packed: PackedSamples) -> None:
    """Point each sample's ids and engine log-probs at its views of ``packed`` (the same values),
    so a group kept with its packed form is held once. A field of another dtype than the packed
    one (not the documented int64 / float32) keeps its own tensor and value."""
    seq = [0, *torch.cumsum(packed.seq_lens, 0).tolist()]
    scored = [0, *torch.cumsum(packed.lengths, 0).tolist()]
    for i, s in enumerate(samples):
        prompt = seq[i] + s.prompt_ids.shape[0]
        views = {"prompt_ids": packed.input_ids[seq[i]:prompt],
                 "response_ids": packed.input_ids[prompt:seq[i + 1]],
                 "behavior_logprobs": packed.behavior_logprobs[scored[i]:scored[i + 1]]}
        for name, view in views.items():
            if getattr(s, name).dtype == view.dtype:
                setattr(s, name, view)



def shard_quota(groups: int, num_shards: int, shard: int) -> int:
    """Groups DP shard ``shard`` trains per step: ``groups`` split as evenly as it goes, the first
    ``groups % num_shards`` shards taking one more (32 on 3 shards: 11, 11, 10). Arrivals are
    dealt round-robin by ``shard_of``, so shards' inflows differ by at most about one group per
    rollout worker, and the loss is normalised by the step's tokens over all shards, so uneven
    shares train the same objective."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} outside 0..{num_shards - 1}")
    if groups < num_shards:
        raise ValueError(f"{groups} groups a step cannot give each of {num_shards} DP shards one")
    return groups // num_shards + (1 if shard < groups % num_shards else 0)


def shard_of(group_id: int, num_shards: int, num_workers: int) -> int:
    """DP shard that owns a group: its worker's groups dealt round-robin over the shards.

    A group id is ``index * num_workers + worker`` (``rollout/worker.py``: ``index`` counts the
    worker's groups, restarts and resumes continue it), and worker ``w``'s group ``index`` goes to
    shard ``(index + w) % num_shards``. Any run of consecutive groups of one worker thus gives each
    shard the same count within one, so the shards' inflows over any stretch differ by at most
    about ``num_workers`` groups, whatever the workers' speeds: with B groups a step each shard
    gets close to its quota (``shard_quota``). A hash (splitmix64, before) gave each shard a
    Binomial(B, 1/DP) count a step, and a shard that got fewer than its quota trained fewer while
    the other's surplus waited: 243 of 256 samples a step at B = 32 on 2 shards. The offset ``w``
    starts the workers on different shards, so W workers of one group each still cover W shards.

    The sender (``transport/channel.py``) and the owner checks (``replay/buffer.py``,
    ``step/planner.py``) all call this one function with the run's worker count
    (``cluster.rollout_workers``), which a resume may not change (``launch/resume_changes.py``);
    a restored buffer entry keeps the shard stored with it. Pure integer arithmetic: stable across
    processes and Python versions.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if group_id < 0:
        raise ValueError(f"group_id must be >= 0, got {group_id}")
    return (group_id // num_workers + group_id % num_workers) % num_shards
