"""The engine contract shared by every rollout backend (``hf``, ``vllm``) and their users.

The rollout worker, the evaluation harness and the weight-sync receiver only ever talk to an
``Engine``: prompts in as token ids, ``n`` sampled responses out with the engine's own
sampled-token log-probs (the behavior density; never recomputed), and HF-named weights in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


@dataclass
class SamplingConfig:
    """How responses are sampled."""

    n: int = 1  # responses per prompt (the GRPO group size G)
    max_new_tokens: int = 512  # length limit of one response
    temperature: float = 1.0  # softmax temperature; 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # -1 disables top-k
    seed: int = 0  # base seed; engines derive per-request seeds from it
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS


@dataclass
class EngineConfig:
    """Which backend runs generation, on what."""

    backend: str = "hf"  # "hf" (transformers generate) or "vllm"
    model_path: str = ""  # Hugging Face checkpoint directory
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU), "bf16", "fp16", "fp32"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    max_batch_size: int = 64  # sequences generated together
    compile: bool = True  # hf: static cache + torch.compile on GPU (ignored on CPU)
    tensor_parallel_size: int = 1  # vllm: engine TP size
    gpu_memory_utilization: float = 0.85  # vllm: fraction of GPU memory for weights + KV cache


@dataclass
class Generation:
    """One sampled response."""

    token_ids: torch.Tensor  # (T,) int64 generated ids, EOS included when generated
    logprobs: torch.Tensor  # (T,) float32 engine log-prob of each sampled token
    finish_reason: str  # "stop" (EOS or stop token) or "length"


class Engine(Protocol):
    """What every backend implements."""

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
