"""Hydra composition of the run's typed config (``megatron_darl.loop.run_config.RunConfig``).

``RunConfig`` is registered in Hydra's ConfigStore as ``run_schema`` (the first entry of
``configs/config.yaml``'s defaults list), so every preset is type-checked against it.
``load_run_config`` composes (Hydra's compose API: no working-directory change, no logging
takeover) or reads a saved ``run_config.yaml`` and converts to dataclasses once with
``OmegaConf.to_object``; nothing past ``launch/`` sees a DictConfig.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megatron_darl.loop.run_config import (  # noqa: F401 (the schema, re-exported for launch/)
    ROLLOUT_FAILURE, ClusterConfig, RunConfig, check_consistent,
)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def register_schema() -> None:
    """Register ``RunConfig`` as ``run_schema`` and the ``dp_size`` resolver (idempotent)."""
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    if not OmegaConf.has_resolver("dp_size"):
        OmegaConf.register_new_resolver(
            "dp_size", lambda ranks, tp, pp: int(ranks) // (int(tp) * int(pp)))


def compose(overrides: Sequence[str] = (), config_dir: Path = CONFIG_DIR) -> DictConfig:
    """Compose ``configs/config.yaml`` with command-line ``overrides`` (Hydra syntax)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None, job_name="darl"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def apply_gpu_counts(node: DictConfig) -> DictConfig:
    """``cluster.trainer_gpus`` / ``rollout_gpus`` (> 0) set the ranks, workers and devices they
    imply: trainer ranks on GPUs 0..T-1, one rollout worker on each of GPUs T..T+R-1. Runs before
    interpolation, so ``transport.control.num_workers`` and ``num_hubs`` follow; idempotent."""
    c = node.cluster
    trainer, rollout = int(c.get("trainer_gpus") or 0), int(c.get("rollout_gpus") or 0)
    if trainer > 0:
        c.trainer_ranks, c.trainer_devices = trainer, list(range(trainer))
    if rollout > 0:
        first = trainer if trainer > 0 else int(c.trainer_ranks)
        c.rollout_workers, c.rollout_devices = rollout, list(range(first, first + rollout))
    return node


def to_run_config(node: DictConfig) -> RunConfig:
    """Resolve interpolations and convert to dataclasses (runs every ``__post_init__`` check)."""
    register_schema()
    node = apply_gpu_counts(OmegaConf.merge(OmegaConf.structured(RunConfig), node))
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


def save_run_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config (what every child process loads), without the run's secret:
    that travels in the children's environment only (``launch.lifeline``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    node = OmegaConf.structured(cfg)
    node.transport.control.secret = ""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(OmegaConf.to_yaml(node))
    tmp.replace(path)  # a reader never sees half a config
    return path
