"""Supervised warm start for the embedded default: the initial tiny policy, cached on disk.

RL from a random policy on the built-in task has no signal (every reward is 0, every group is
degenerate), so when no initial checkpoint is given, the embedded default first fits a tiny
Qwen3-architecture model to the task's step-by-step reference solutions for a few hundred
steps, stopping while it is still imperfect so the RL phase has something to improve.

What RL improves is chosen on purpose: only ``answer_line_prob`` of the supervised targets end
with the rewarded ``answer: N`` line (the rest stop after the worked steps), so the initial
policy writes the verifiable final line only some of the time, like a base model that has not
yet learned a task's answer format. Fitting a tiny model's arithmetic further by RL does not
work on a CPU budget (measured: online GRPO from a 1M-parameter policy at 0.62 sampled accuracy
lowered held-out accuracy at every setting tried, Adam 3e-5 to 1e-3 and SGD 0.1 to 0.3: the
model memorises its batches rather than sharpening), whereas a consistent format signal is learned within tens of steps, which is the
same signal R1-style RL gets first on real models. The
result is an ordinary Hugging Face checkpoint (config, safetensors, the task's tokenizer) in a
cache directory keyed by everything that determines it, so a second run reuses it
(``launch/warmstart.py``: the cache, which a launch asks without importing torch).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megatron_darl.data.builtin import build_builtin_tokenizer, builtin_prompts, reference_solution
from megatron_darl.models.config import TinyModelConfig, WarmStartConfig


def _hf_config(cfg: TinyModelConfig, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def _builtin_sequences(cfg: WarmStartConfig, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids + EOS) of the built-in task's worked solutions."""
    records = builtin_prompts(cfg.num_prompts, cfg.prompt_seed, max_operands=cfg.max_operands,
                              max_value=cfg.max_value)
    seqs = []
    keep_answer = torch.rand(len(records), generator=torch.Generator().manual_seed(cfg.seed + 1))
    for rec, u in zip(records, keep_answer.tolist()):
        prompt = tokenizer(rec.prompt, add_special_tokens=True)["input_ids"]
        target = reference_solution(rec)
        if u >= cfg.answer_line_prob:  # worked steps only: no "answer: N" line, reward 0
            target = target.rsplit("\n", 1)[0]
        answer = tokenizer(target, add_special_tokens=False)["input_ids"]
        seqs.append((prompt, answer + [tokenizer.eos_token_id]))
    return seqs


def shuffled_batches(seqs: list[tuple[list[int], list[int]]], batch_size: int, seed: int, pad_id: int,
                     device: torch.device):
    """Endless shuffled batches of (prompt, target) pairs: (ids (B, L), labels (B, L) with -100
    outside the targets)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(len(seqs), generator=gen).split(batch_size):
            chunk = [seqs[i] for i in idx.tolist()]
            width = max(len(p) + len(a) for p, a in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            labels = torch.full_like(ids, -100)
            for row, (p, a) in enumerate(chunk):
                ids[row, : len(p) + len(a)] = torch.tensor(p + a)
                labels[row, len(p): len(p) + len(a)] = torch.tensor(a)
            yield ids.to(device), labels.to(device)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextlib.contextmanager
def deterministic_fit(device: torch.device) -> Iterator[None]:
    """On a GPU, the fit in deterministic kernels, so that two machines of one kind fit the same
    policy bit for bit: atomics (the embedding's and attention's backward) otherwise order their
    sums by timing, and two fits of one key started RL from held-out accuracy 0.037 and 0.057,
    which makes the runs of a study that ran on two machines start apart. The attention runs in
    SDPA's math kernels (plain matmuls and softmax); cuBLAS gets the fixed workspace that its
    deterministic mode asks for. A kernel with no deterministic form warns (``warn_only``) rather
    than failing the fit. Settings are put back after the fit; a CPU fit is left as it was."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS first runs
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]


def fit_sequences(cfg: WarmStartConfig, out_dir: Path, sequences: Callable[[Any], list],
                  log=print, tag: str = "warmstart") -> Path:
    """Fit the tiny policy to ``sequences(tokenizer)`` (prompt, target) pairs and save it (HF
    format, with the built-in tokenizer) to ``out_dir``."""
    device = _resolve_device(cfg.device)
    with deterministic_fit(device):
        return _fit(cfg, out_dir, sequences, device, log, tag)


def _fit(cfg: WarmStartConfig, out_dir: Path, sequences: Callable[[Any], list], device: torch.device,
         log, tag: str) -> Path:
    from transformers import Qwen3ForCausalLM

    tokenizer = build_builtin_tokenizer(out_dir)
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(_hf_config(cfg.model, tokenizer)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.steps, eta_min=cfg.lr * 0.1)
    batches = shuffled_batches(sequences(tokenizer), cfg.batch_size, cfg.seed, tokenizer.pad_token_id, device)
    start = time.time()
    for step in range(1, cfg.steps + 1):
        ids, labels = next(batches)
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(),
                     labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == cfg.steps:
            log(f"[{tag}] step {step}/{cfg.steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def fit_policy(cfg: WarmStartConfig, out_dir: Path, log=print) -> Path:
    """Fit the tiny policy to the built-in task and save it (HF format, with tokenizer) to ``out_dir``."""
    return fit_sequences(cfg, out_dir, lambda tokenizer: _builtin_sequences(cfg, tokenizer), log=log)
