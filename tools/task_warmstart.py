"""Fit (or reuse) a tiny policy that knows a generated task's format, not its skill.

The embedded default's warm start (``megatron_darl.loop.warmstart``) fits the arithmetic task
only. For another generated task (``data=countdown``) this fits the same tiny Qwen3-architecture
policy, with the same character tokenizer, to the task's *format* targets: for countdown a
random valid chain over the prompt's numbers that ignores the target, so RL starts at the chance
rate and has the whole search to learn. The result is an HF directory in the same cache, keyed
by everything that determines it; pass it as ``model.path``::

    python -m launch.train data=countdown model.path=$(python tools/task_warmstart.py --data countdown)

Options after ``--data`` are ``key=value`` overrides of the data preset (``countdown.max_numbers=5``)
and ``--set`` overrides of the warm start (``warmstart.steps=600``, ``warmstart.model.hidden_size=768``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_darl.data.builtin import build_builtin_tokenizer  # noqa: E402
from megatron_darl.data.config import DataConfig, load_data_config  # noqa: E402
from megatron_darl.data.countdown import format_example  # noqa: E402
from megatron_darl.data.loaders import load_dataset  # noqa: E402
from megatron_darl.data.records import PromptRecord  # noqa: E402
from megatron_darl.loop.warmstart import WarmStartConfig, _hf_config, _resolve_device  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# task -> writer of the warm-start target of a record (format only); one entry per generated task
FORMAT_TARGETS: dict[str, Callable[[PromptRecord, random.Random, DataConfig], str]] = {
    "countdown": lambda rec, rng, data: format_example(rec, rng, data.countdown.operators,
                                                       data.countdown.order),
}


def example_data(data: DataConfig, ws: WarmStartConfig) -> DataConfig:
    """The data config of the warm-start prompts: the train split, its own seed and size (the
    reward's partial credit does not change the fit, so it is left out of the cache key)."""
    if data.task not in FORMAT_TARGETS:
        raise ValueError(f"data.task={data.task!r}: no format targets (known: {', '.join(FORMAT_TARGETS)}); "
                         "the arithmetic task warm-starts inside launch.train")
    cd = dataclasses.replace(data.countdown, split="train", seed=ws.prompt_seed, num_prompts=ws.num_prompts,
                             valid_chain_reward=0.0)
    return dataclasses.replace(data, countdown=cd)


def task_cache_key(data: DataConfig, ws: WarmStartConfig) -> str:
    """Hash of everything that determines the fitted policy (cache dir and device excluded)."""
    payload = {"warmstart": dataclasses.asdict(ws), "data": dataclasses.asdict(example_data(data, ws))}
    for key in ("cache_dir", "device"):
        payload["warmstart"].pop(key)
    return "task-" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _batches(data: DataConfig, ws: WarmStartConfig, tokenizer, device: torch.device):
    """Endless shuffled batches: (ids (B, L), labels (B, L) with -100 outside the targets)."""
    rng = random.Random(ws.seed + 1)
    records = load_dataset(example_data(data, ws)).records
    target = FORMAT_TARGETS[data.task]
    seqs = []
    for rec in records:
        prompt = tokenizer(rec.prompt, add_special_tokens=True)["input_ids"]
        answer = tokenizer(target(rec, rng, data), add_special_tokens=False)["input_ids"]
        seqs.append((prompt, answer + [tokenizer.eos_token_id]))
    gen = torch.Generator().manual_seed(ws.seed)
    while True:
        for idx in torch.randperm(len(seqs), generator=gen).split(ws.batch_size):
            chunk = [seqs[i] for i in idx.tolist()]
            width = max(len(p) + len(a) for p, a in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            labels = torch.full_like(ids, -100)
            for row, (p, a) in enumerate(chunk):
                ids[row, : len(p) + len(a)] = torch.tensor(p + a)
                labels[row, len(p): len(p) + len(a)] = torch.tensor(a)
            yield ids.to(device), labels.to(device)


def fit_task_policy(data: DataConfig, ws: WarmStartConfig, out_dir: Path, log=print) -> Path:
    """Fit the tiny policy to the task's format targets and save it (HF, with tokenizer)."""
    from transformers import Qwen3ForCausalLM

    device = _resolve_device(ws.device)
    tokenizer = build_builtin_tokenizer(out_dir)
    torch.manual_seed(ws.seed)
    model = Qwen3ForCausalLM(_hf_config(ws.model, tokenizer)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, ws.steps, eta_min=ws.lr * 0.1)
    batches, start = _batches(data, ws, tokenizer, device), time.time()
    for step in range(1, ws.steps + 1):
        ids, labels = next(batches)
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(),
                     labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == ws.steps:
            log(f"[task_warmstart] step {step}/{ws.steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def ensure_task_policy(data: DataConfig, ws: WarmStartConfig, log=print) -> Path:
    """The cached format-only policy of ``data``'s task, fitted first when absent (atomic rename)."""
    root = Path(ws.cache_dir).expanduser()
    final = root / task_cache_key(data, ws)
    if (final / "config.json").exists():
        log(f"[task_warmstart] reusing {final}")
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"[task_warmstart] fitting {data.task} format policy ({ws.steps} steps) into {final}")
    fit_task_policy(data, ws, tmp, log=log)
    tmp.rename(final)
    return final


def load_configs(preset: str, data_overrides: list[str], ws_overrides: list[str]) -> tuple[DataConfig, WarmStartConfig]:
    """The data preset (``configs/data/<preset>.yaml`` or a path) and the warm start, overridden."""
    from omegaconf import OmegaConf

    path = Path(preset) if preset.endswith(".yaml") else REPO / "configs" / "data" / f"{preset}.yaml"
    data = load_data_config(path, OmegaConf.to_container(OmegaConf.from_dotlist(data_overrides)))
    bad = [o for o in ws_overrides if not o.startswith("warmstart.")]
    if bad:
        raise ValueError(f"--set {bad[0]}: warm-start overrides start with 'warmstart.'")
    node = OmegaConf.merge(OmegaConf.structured(WarmStartConfig),
                           OmegaConf.from_dotlist([o[len("warmstart."):] for o in ws_overrides]))
    return data, OmegaConf.to_object(node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="countdown", help="configs/data preset (or a YAML path)")
    parser.add_argument("--set", action="append", default=[], help="warmstart.KEY=VALUE override")
    parser.add_argument("overrides", nargs="*", help="data KEY=VALUE overrides (countdown.max_numbers=5)")
    args = parser.parse_args(argv)
    try:
        data, ws = load_configs(args.data, args.overrides, args.set)
    except (ValueError, FileNotFoundError) as err:
        print(f"task_warmstart: {err}", file=sys.stderr)
        return 2
    print(ensure_task_policy(data, ws, log=lambda m: print(m, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
