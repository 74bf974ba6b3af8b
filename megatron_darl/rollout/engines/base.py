"""The engine contracts shared by every rollout backend (``hf``, ``vllm``) and their users.

The rollout worker, the evaluation harness and the weight-sync receiver only ever talk to an
engine: prompts in as token ids, ``n`` sampled responses out with the engine's own sampled-token
log-probs (the behavior density; never recomputed), and HF-named weights in.

Two shapes of the same contract:

- ``Engine`` (batch): ``generate(prompts)`` returns when every response is done. The ``hf``
  backend is one; the evaluation harness needs nothing more.
- ``StreamingEngine``: the rollout worker's view. ``submit`` one prompt group, ``poll`` for the
  groups that finished (a group comes back the moment its ``n`` responses are done, in any
  order), and ``pause`` / ``load_weights`` / ``resume`` at a weight sync. ``vllm`` implements it
  natively (continuous batching); any batch engine gets it from ``engines.stream.BatchStream``,
  so the worker has one code path for both.

Every generated token carries the weight version that produced it (``Generation.token_versions``):
``resume(version)`` names the version of the weights loaded, and a sample interrupted by a weight
load (``pause(interrupt=True)``) continues on the new weights with its later tokens tagged so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Protocol

import torch

from megatron_darl.rollout.config import SamplingConfig


@dataclass
class Generation:
    """One sampled response."""

    token_ids: torch.Tensor  # (T,) int64 generated ids, EOS included when generated
    logprobs: torch.Tensor  # (T,) float32 engine log-prob of each sampled token
    finish_reason: str  # "stop" (EOS or stop token) or "length"
    token_versions: torch.Tensor | None = None  # (T,) int64 weight version per token; None: untracked


@dataclass
class FinishedGroup:
    """A submitted prompt group whose ``n`` responses are all done."""

    key: Hashable  # what the caller passed to ``submit``
    generations: list[Generation]  # the n responses, each with ``token_versions`` set


class Engine(Protocol):
    """What every backend implements (batch generation)."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Generation]]:
        """Sample ``sampling.n`` responses for each prompt; result[i] belongs to prompts[i]."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the engine's weights in place."""
        ...

    def close(self) -> None:
        """Release the engine's memory and processes."""
        ...


class StreamingEngine(Protocol):
    """The rollout worker's engine: groups in and out one at a time, weights loaded in between."""

    def submit(self, key: Hashable, prompt: list[int], sampling: SamplingConfig) -> None:
        """Start ``sampling.n`` responses to ``prompt``; returns at once."""
        ...

    def poll(self, timeout_s: float) -> list[FinishedGroup]:
        """Groups finished since the last call; waits up to ``timeout_s`` for one while any is in
        flight (a batch engine generates here). Raises ``RuntimeError`` if the engine failed."""
        ...

    def inflight(self) -> int:
        """Groups submitted and not yet returned by ``poll``."""
        ...

    def pause(self, interrupt: bool) -> None:
        """Stop generating before a weight load. ``interrupt=False`` (mode ``finish``) requires no
        group in flight; ``interrupt=True`` stops in-flight responses where they are, keeping
        their tokens, to continue after ``resume``."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the engine's weights in place (between pause and resume)."""
        ...

    def resume(self, version: int) -> None:
        """The engine holds weights ``version`` (-1: none valid): drop cached KV of older weights,
        continue interrupted responses and tag every token generated from now on with it."""
        ...

    def close(self) -> None:
        """Release the engine's memory and processes."""
        ...
