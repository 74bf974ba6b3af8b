"""Fit (or reuse) a tiny policy that knows a generated task's format, not its skill.

The embedded default's warm start (``launch.warmstart``) fits the arithmetic task
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
import sys
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_darl.data.config import DataConfig, load_data_config  # noqa: E402
from megatron_darl.data.countdown import format_example  # noqa: E402
from megatron_darl.data.loaders import load_dataset  # noqa: E402
from megatron_darl.data.records import PromptRecord  # noqa: E402
from launch.warmstart import cached_fit  # noqa: E402
from launch.warmstart_fit import fit_sequences  # noqa: E402
from megatron_darl.models.config import WarmStartConfig

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


def _sequences(data: DataConfig, ws: WarmStartConfig, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, format target ids + EOS) of the task's example records."""
    rng = random.Random(ws.seed + 1)
    target = FORMAT_TARGETS[data.task]
    seqs = []
    for rec in load_dataset(example_data(data, ws)).records:
        prompt = tokenizer(rec.prompt, add_special_tokens=True)["input_ids"]
        answer = tokenizer(target(rec, rng, data), add_special_tokens=False)["input_ids"]
        seqs.append((prompt, answer + [tokenizer.eos_token_id]))
    return seqs


def fit_task_policy(data: DataConfig, ws: WarmStartConfig, out_dir: Path, log=print) -> Path:
    """Fit the tiny policy to the task's format targets and save it (HF, with tokenizer)."""
    return fit_sequences(ws, out_dir, lambda tokenizer: _sequences(data, ws, tokenizer), log=log,
                         tag="task_warmstart")


def ensure_task_policy(data: DataConfig, ws: WarmStartConfig, log=print) -> Path:
    """The cached format-only policy of ``data``'s task, fitted first when absent (atomic rename)."""
    return cached_fit(ws, task_cache_key(data, ws), lambda tmp: fit_task_policy(data, ws, tmp, log=log),
                      f"{data.task} format policy", log=log, tag="task_warmstart")


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
