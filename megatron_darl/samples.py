"""Typed records that cross component boundaries: one generated ``Sample`` and its ``SampleGroup``.

They live in their own module because rollout produces them, transport frames them, replay stores
them and the loop consumes them, and none of those may import the others (docs/architecture.md,
Layers and imports). ``shard_of`` is here for the same reason: the sample channel routes a group to
the DP hub that the replay buffer files it under, and both must agree. The module imports nothing of
ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


_MASK64 = (1 << 64) - 1


def shard_of(group_id: int, num_shards: int) -> int:
    """DP shard that owns a group: a stable 64-bit mix (splitmix64) of the id, mod ``num_shards``.

    Stable across processes and Python versions (unlike ``hash``) and balanced even when group
    ids carry a worker id in fixed bit positions.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    z = (group_id + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % num_shards
