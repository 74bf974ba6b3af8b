"""Hydra composition of the run's typed config (``megatron_darl.loop.run_config.RunConfig``).

``RunConfig`` is registered in Hydra's ConfigStore as ``run_schema`` (the first entry of
``configs/config.yaml``'s defaults list), so every preset is type-checked against it.
``load_run_config`` composes (Hydra's compose API: no working-directory change, no logging
takeover) or reads a saved ``run_config.yaml`` and converts to dataclasses once with
``OmegaConf.to_object``; nothing past ``launch/`` sees a DictConfig.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from launch import split as sp
from megatron_darl.loop.run_config import (  # noqa: F401 (the schema, re-exported for launch/)
    ROLLOUT_FAILURE, ClusterConfig, RunConfig, check_consistent,
)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# Group spellings that older commands, scripts and saved records use, and the group they mean:
# configs/rollout/ was selected as ``rollout@_global_=vllm`` before its presets said
# ``@package _global_`` themselves; ``rollout=vllm`` is the name ``--help`` prints.
GROUP_ALIASES = {"rollout@_global_": "rollout"}


def canonical_override(item: str) -> str:
    """``item`` with an old group spelling (``GROUP_ALIASES``) replaced by the group's name."""
    key, sep, value = item.partition("=")
    prefix = key[: len(key) - len(key.lstrip("+~"))]
    name = key[len(prefix):]
    return f"{prefix}{GROUP_ALIASES[name]}{sep}{value}" if sep and name in GROUP_ALIASES else item


def register_schema() -> None:
    """Register ``RunConfig`` as ``run_schema`` and the data resolver (idempotent)."""
    from megatron_darl.data.locations import register_resolver

    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    register_resolver()  # ${benchmark_home:}: where configs/data/*.yaml find the benchmark files


def compose(overrides: Sequence[str] = (), config_dir: Path = CONFIG_DIR) -> DictConfig:
    """Compose ``configs/config.yaml`` with command-line ``overrides`` (Hydra syntax)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None, job_name="darl"):
        return hydra_compose(config_name="config", overrides=[canonical_override(o) for o in overrides])


def apply_gpu_counts(node: DictConfig) -> DictConfig:
    """``cluster.trainer_gpus`` / ``rollout_gpus`` (> 0) set the ranks, workers and devices they
    imply: trainer ranks on GPUs 0..T-1, one rollout worker on each of GPUs T..T+R-1 (the run's
    topology, ``RunConfig.topology``, follows from these); idempotent.
    ``cluster.split`` ("T:R" or "auto") sets both counts first (``apply_split``)."""
    apply_split(node)
    c = node.cluster
    trainer, rollout = int(c.get("trainer_gpus") or 0), int(c.get("rollout_gpus") or 0)
    if trainer > 0:
        c.trainer_ranks, c.trainer_devices = trainer, list(range(trainer))
    if rollout > 0:
        first = trainer if trainer > 0 else int(c.trainer_ranks)
        c.rollout_workers, c.rollout_devices = rollout, list(range(first, first + rollout))
    return node


def apply_split(node: DictConfig, gpu_count: Callable[[], int] | None = None,
                device: Callable[[], str | None] | None = None) -> DictConfig:
    """Resolve ``cluster.split`` into ``trainer_gpus`` / ``rollout_gpus`` and leave it as "T:R"
    (a saved config never says "auto": child processes must not decide again).

    The GPUs to split: ``trainer_gpus + rollout_gpus`` when both are set (``cluster=gpu4``: 4), else
    the ones visible (``gpu_count``, default ``launch.split.visible_gpus``). "auto" logs its reason
    on ``launch.split`` (``launch/split.py`` has the model)."""
    c = node.cluster
    text = str(c.get("split") or "").strip()
    if not text:
        return node
    t0, r0 = int(c.get("trainer_gpus") or 0), int(c.get("rollout_gpus") or 0)
    n = t0 + r0 if t0 > 0 and r0 > 0 else None
    if text == "auto":
        n = n if n is not None else (gpu_count or sp.visible_gpus)()
        if n < 2:
            raise ValueError(f"cluster.split=auto needs >= 2 GPUs (one to train, one to generate); "
                             f"{n} visible and no cluster.trainer_gpus + cluster.rollout_gpus to split")
        choice = sp.decide(split_request(node, n), OmegaConf.to_object(c.rates), (device or sp.gpu_name)())
        logging.getLogger("launch.split").info("%s", choice.why)
        t, r = choice.trainer_gpus, choice.rollout_gpus
    else:
        t, r = sp.parse_split(text)
        have = n if n is not None else (gpu_count or sp.visible_gpus)()
        if (n is not None and t + r != n) or (n is None and 0 < have < t + r):
            raise ValueError(f"cluster.split={text!r} needs {t + r} GPUs but "
                             + (f"cluster.trainer_gpus + cluster.rollout_gpus = {n}" if n is not None
                                else f"{have} are visible"))
    c.split, c.trainer_gpus, c.rollout_gpus = f"{t}:{r}", t, r
    return node


def split_request(node: DictConfig, n_gpus: int) -> sp.SplitRequest:
    """The run's ``launch.split.SplitRequest`` (plain values) from the composed config."""
    a, m = node.algorithm, node.model
    if m.get("hf_config"):
        shape = OmegaConf.to_container(m.hf_config, resolve=True)
    elif m.get("path") and (Path(str(m.path)) / "config.json").is_file():
        shape = json.loads((Path(str(m.path)) / "config.json").read_text())
    else:  # the embedded default's warm-started policy (character vocabulary, about 100 tokens)
        shape = {**OmegaConf.to_container(node.warmstart.model, resolve=True), "vocab_size": 128}
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size")
    return sp.SplitRequest(
        n_gpus=n_gpus, groups=int(a.groups_per_step), group_size=int(a.group_size),
        new_tokens=int(node.sampling.max_new_tokens), variant=str(a.variant), overlap=int(a.max_staleness) > 0,
        tp=int(node.parallel.tp), pp=int(node.parallel.pp), model=str(m.name), engine=str(node.engine.backend),
        model_shape=tuple((k, int(shape[k])) for k in keys if shape.get(k) is not None))


def check_layout_divides(node: DictConfig) -> None:
    """TP x PP divides the trainer ranks, checked before conversion: a remainder would otherwise
    surface as a hub count of 0 (the DP size, ``RunConfig.topology``)."""
    ranks, tp, pp = int(node.cluster.trainer_ranks), int(node.parallel.tp), int(node.parallel.pp)
    if tp < 1 or pp < 1:
        raise ValueError(f"parallel.tp={tp}, parallel.pp={pp}: both must be >= 1")
    if ranks % (tp * pp):
        raise ValueError(f"parallel.tp={tp} x parallel.pp={pp} = {tp * pp} does not divide "
                         f"cluster.trainer_ranks={ranks}: use a multiple of {tp * pp} trainer ranks "
                         "(cluster.trainer_ranks, or cluster.trainer_gpus) or a smaller TP x PP")


def to_run_config(node: DictConfig) -> RunConfig:
    """Resolve interpolations and convert to dataclasses (runs every ``__post_init__`` check)."""
    register_schema()
    node = apply_gpu_counts(OmegaConf.merge(OmegaConf.structured(RunConfig), node))
    check_layout_divides(node)
    return OmegaConf.to_object(node)


def load_run_config(overrides: Sequence[str] = (), config_file: str | Path | None = None) -> RunConfig:
    """From a saved ``run_config.yaml`` (children of ``launch.train``) or by composing."""
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"run config {path} does not exist")
        node = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
        return to_run_config(node)
    return to_run_config(compose(overrides))


def write_private(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by this user only (mode 0600, also over an existing
    file), atomically: run files name the control store's address and port."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a stale tmp file keeps its mode through O_CREAT
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def save_run_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config (what every child process loads) readable by this user only
    and without the run's secret, which the launcher hands each child (``launch.lifeline``)."""
    node = OmegaConf.structured(cfg)
    node.transport.control.secret = ""
    return write_private(path, OmegaConf.to_yaml(node))
