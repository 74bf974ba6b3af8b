"""Tiny random Qwen3 checkpoints for the vLLM GPU tests (written by the tests; no download).

The built-in task's character tokenizer goes with the weights, so the same checkpoint serves the
engine tests and the main job (whose prompts are that task's). Shapes are ones vLLM's attention
kernels take (head_dim 64). ``logit_std`` scales the LM head so that the next-token distribution
is far from uniform (a random init gives near-uniform logits): then temperature and truncation
change log-probs by much more than bf16 rounding, and a test can tell processed log-probs from raw
ones. The head is untied so that scaling it does not make the model predict its input token.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

VLLM_SAFE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def vllm_environment() -> None:
    """What ``launch.rollout`` sets before building a vLLM engine (the tests build one directly)."""
    from launch.engine_env import apply_engine_env
    from megatron_darl.rollout.config import EngineConfig

    apply_engine_env(EngineConfig(backend="vllm"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def qwen3_config(vocab_size: int, **special):
    import transformers

    vocab = (vocab_size + 63) // 64 * 64
    return transformers.Qwen3Config(vocab_size=vocab, **VLLM_SAFE, **special)


def random_qwen3(config, seed: int, logit_std: float = 1.5):
    """A random Qwen3 whose logits spread about ``logit_std`` (LM head rescaled)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        head = model.lm_head.weight
        head.mul_(logit_std / (head.std() * config.hidden_size ** 0.5))
    return model


def save_tiny_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """Built-in task tokenizer + a random tiny Qwen3 in bf16 at ``path``."""
    from megatron_darl.data.builtin import build_builtin_tokenizer

    path = Path(path)
    tok = build_builtin_tokenizer(path)
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = random_qwen3(qwen3_config(len(tok), **special), seed)
    model.to(torch.bfloat16).save_pretrained(str(path))
    return path
