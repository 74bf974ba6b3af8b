"""A sharded, resumable prompt source for rollout workers.

Each worker reads only its own shard (every ``num_shards``-th prompt of a per-epoch permutation),
so workers never generate the same prompt in the same epoch, and its position is a two-integer
``state_dict`` that the worker checkpoints to resume exactly where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, tokenized, plus the dataset row the reward function needs."""

    prompt_id: int  # stable id of the prompt in its dataset
    token_ids: tuple[int, ...]  # chat-templated prompt token ids
    record: Any = None  # the raw row (answer, tests, ...) handed to reward_fn


@dataclass
class PromptSourceState:
    """Position of a prompt source."""

    epoch: int = 0  # passes over this shard completed
    index: int = 0  # next position inside the current epoch's shard


class PromptSource:
    """Endless iterator over one shard of ``records``, reshuffled every epoch.

    Args:
        shard: this worker's shard (its worker id); num_shards: workers in total.
        seed: permutation seed, shared by all shards so that shards partition each epoch.
    """

    def __init__(self, records: Sequence[PromptRecord], shard: int, num_shards: int,
                 seed: int = 0, shuffle: bool = True) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, num_shards={num_shards}), got {shard}")
        if len(records) < num_shards:
            raise ValueError(f"{len(records)} prompts cannot be split into {num_shards} shards")
        self._records, self.shard, self.num_shards = records, shard, num_shards
        self.seed, self.shuffle = seed, shuffle
        self.state = PromptSourceState()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        n = len(self._records)
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(n, generator=gen).tolist()
        else:
            perm = list(range(n))
        return perm[self.shard :: self.num_shards]

    def next(self) -> PromptRecord:
        """The next prompt of this shard (wrapping into a new epoch)."""
        if self.state.index >= len(self._order):
            self.state = PromptSourceState(epoch=self.state.epoch + 1, index=0)
            self._order = self._epoch_order(self.state.epoch)
        record = self._records[self._order[self.state.index]]
        self.state.index += 1
        return record

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "index": self.state.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = PromptSourceState(epoch=int(state["epoch"]), index=int(state["index"]))
        self._order = self._epoch_order(self.state.epoch)
