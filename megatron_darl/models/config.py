"""Configs of the embedded default policy: its shape and how it is warm-started.

The run config holds these (``warmstart.*``) in every process; the fitting itself is runtime
code that only the launcher runs, so this module imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TinyModelConfig:
    """Shape of the embedded default's Qwen3-architecture policy (about 1M parameters)."""

    hidden_size: int = 128  # model width
    intermediate_size: int = 384  # SwiGLU width
    num_hidden_layers: int = 4  # transformer layers
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # GQA key/value heads
    head_dim: int = 32  # per-head width
    max_position_embeddings: int = 256  # longest prompt + response
    tie_word_embeddings: bool = True  # share embedding and LM head


@dataclass
class WarmStartConfig:
    """How the initial policy is fitted to reference solutions."""

    model: TinyModelConfig = field(default_factory=TinyModelConfig)  # policy shape
    steps: int = 300  # optimizer steps of supervised training
    batch_size: int = 64  # sequences per step
    lr: float = 3e-3  # AdamW learning rate (cosine-decayed to 10%)
    seed: int = 0  # model init and data order
    num_prompts: int = 2048  # training prompts (a seed disjoint from the RL prompts)
    prompt_seed: int = 12345  # seed of the training prompts
    max_operands: int = 3  # difficulty of the training prompts
    max_value: int = 9  # operands drawn from 0..max_value (as configs/data/builtin.yaml)
    answer_line_prob: float = 0.3  # fraction of targets that end with the rewarded answer line
    cache_dir: str = "~/.cache/megatron_darl/warmstart"  # where fitted policies are kept
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda"
