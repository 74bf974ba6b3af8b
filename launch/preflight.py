"""Launcher pre-flight: catch the run's mistakes before any child process starts.

Why: a bad value that only a child process checks (the reward task in the rollout worker, the
TP layout in Megatron, a missing model directory in ``from_pretrained``) surfaces 10-16 s later
as 70-85 lines of someone else's traceback, after everything has started. The checks here
are cheap (one ``config.json`` read, no torch model, no weights) and each failure is one
``ValueError`` line naming the field; ``launch.train`` and ``launch.slurm`` print it and exit 2.
Value checks that need no files live in ``launch.config.check_consistent`` and
``launch.validate.check_values`` (run first here); the dataset is read and its prompts measured
by ``launch.validate.check_inputs`` once the policy is resolved.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def model_shape(cfg) -> tuple[dict[str, Any], str]:
    """The initial policy's HF config (as ``config.json`` holds it) and where it came from."""
    from megatron_darl.models.qwen3.config import load_hf_config_dict

    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not path.is_dir():
            raise ValueError(f"model.path={cfg.model.path}: no such directory (expected a Hugging Face "
                             "checkpoint directory: config.json, weights, tokenizer)")
        try:
            return load_hf_config_dict(path), str(path / "config.json")
        except FileNotFoundError as exc:
            raise ValueError(f"model.path={cfg.model.path}: {exc}") from None
    if cfg.model.hf_config:
        return dict(cfg.model.hf_config), "model.hf_config"
    tiny = cfg.warmstart.model  # the embedded default (vocab: whatever the tokenizer has)
    shape = {k: getattr(tiny, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "head_dim",
                                           "max_position_embeddings", "tie_word_embeddings")}
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rms_norm_eps": 1e-6,
            **shape}, "warmstart.model"


def check_model(cfg) -> None:
    """Architecture, trainer TP/PP and engine TP against the model's shape, and lengths."""
    from megatron_darl.models.qwen3.config import check_layout, spec_from_hf

    hf, source = model_shape(cfg)
    spec = spec_from_hf(hf, source)
    try:
        check_layout(spec, cfg.parallel.tp, cfg.parallel.pp, source)
    except ValueError as exc:
        raise ValueError(f"parallel.{exc}") from None
    engine_tp = cfg.engine.tensor_parallel_size
    if spec.num_heads % engine_tp or spec.num_kv_heads % engine_tp:
        raise ValueError(f"engine.tensor_parallel_size={engine_tp} does not divide num_attention_heads="
                         f"{spec.num_heads} and num_key_value_heads={spec.num_kv_heads} ({source})")
    if cfg.sampling.max_new_tokens >= spec.max_position_embeddings:
        raise ValueError(f"sampling.max_new_tokens={cfg.sampling.max_new_tokens} leaves no room for a prompt "
                         f"in max_position_embeddings={spec.max_position_embeddings} ({source})")


def check_paths(cfg) -> None:
    """Files the children will open: the dataset and the trainer's initial checkpoint."""
    if cfg.data.source == "file" and not Path(cfg.data.path).expanduser().is_file():
        raise ValueError(f"data.path={cfg.data.path}: no such file (dataset {cfg.data.name})"
                         + _fetch_hint(cfg.data.path))
    init = cfg.trainer.init_checkpoint
    if init and not Path(init).expanduser().exists():
        raise ValueError(f"trainer.init_checkpoint={init}: no such directory")


def check_weights(cfg) -> None:
    """A model preset gives a shape (``model.hf_config``), not weights or a tokenizer: the rollout
    engine loads both from ``model.path``, so a run without it could only fail in the workers."""
    if not cfg.model.path and not cfg.model.needs_warm_start:
        raise ValueError(f"model.path is empty: model={cfg.model.name} gives the architecture only (no weights, "
                         "no tokenizer for the rollout engine); pass model.path=<Hugging Face checkpoint "
                         "directory>, e.g. one from huggingface-cli download Qwen/<model> --local-dir DIR")


def _fetch_hint(path: str) -> str:
    """How to get a benchmark file the presets name (``tools/prepare_data.py`` knows them)."""
    from megatron_darl.data.locations import LOCAL_BENCHMARKS, SHARED_BENCHMARKS

    file = Path(path).expanduser().resolve()
    for home in (LOCAL_BENCHMARKS, SHARED_BENCHMARKS):
        if file.is_relative_to(home) and len(file.relative_to(home).parts) > 1:
            return f"; fetch it with python tools/prepare_data.py {file.relative_to(home).parts[0]}"
    return ""


def check_engine(cfg) -> None:
    """The rollout engine can be imported where the launch runs (the children share its Python):
    a missing vLLM is one line here, not a traceback per worker after the trainer started."""
    if cfg.engine.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"engine.backend=vllm: vLLM is not installed for {sys.executable}; install it with "
                         "pip install -e .[vllm] (vllm>=0.20,<0.27, GPU machines), or run the hf engine: "
                         "rollout=hf (Slurm: ROLLOUT=hf)")


def check_task(cfg) -> None:
    """``data.task`` names a reward the registry has (its names only: the verifiers load in the workers)."""
    from megatron_darl.rewards.config import Task

    known = [t.value for t in Task]
    if cfg.data.task not in known:
        raise ValueError(f"data.task={cfg.data.task!r} is not a reward task; known: {', '.join(known)}")
    if cfg.model.needs_warm_start and cfg.data.source == "builtin" and cfg.data.task != "builtin":
        # the embedded warm start fits the arithmetic task's format, not another generated task's
        raise ValueError(f"data.task={cfg.data.task!r} needs model.path: the embedded warm start knows only "
                         f"the arithmetic task; fit one with python tools/task_warmstart.py --data {cfg.data.name}")


def max_positions(cfg) -> int:
    """The policy's context (``max_position_embeddings``), wherever its shape comes from."""
    from megatron_darl.models.qwen3.config import spec_from_hf

    hf, source = model_shape(cfg)
    return spec_from_hf(hf, source).max_position_embeddings


def check_eval(cfg) -> None:
    """``eval.benchmarks`` names known benchmarks whose files are there (a typo would otherwise
    surface in the evaluating worker, after the trainer started)."""
    from megatron_darl.eval.benchmarks import check_benchmarks

    try:
        check_benchmarks(cfg.eval)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None


def preflight(cfg) -> None:
    """Every pre-flight check; the first failure raises a one-line ``ValueError``."""
    from launch.validate import check_values
    from megatron_darl.rewards.custom import check_reward  # reward.fn resolves to a function

    check_values(cfg)
    check_weights(cfg)
    check_engine(cfg)
    check_task(cfg)
    check_reward(cfg)
    check_paths(cfg)
    check_model(cfg)
    check_eval(cfg)
