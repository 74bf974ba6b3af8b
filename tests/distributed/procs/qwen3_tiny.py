"""Tiny random Qwen3 checkpoints and their HF reference logits, shared by the Qwen3 tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300  # not a multiple of 128: exercises vocab padding (padded to 384)
SEQ = 12


def tiny_config(tie: bool, vocab: int = VOCAB, layers: int = 4):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_theta": 1e6}, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        architectures=["Qwen3ForCausalLM"],
    )


def make_tiny_hf(path: str | Path, tie: bool, seed: int = 0, **kw):
    """Save a random tiny Qwen3 (norm weights randomised too) and return the HF model."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(tiny_config(tie, **kw)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF inits norms to 1: make a q/k-norm mix-up visible
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return model


def input_ids(batch: int = 2, seq: int = SEQ, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()
