"""Hydra composition into the typed RunConfig: presets, the variant table, validation, round trip."""

import dataclasses

import pytest

from launch.config import RunConfig, load_run_config, save_run_config
from megatron_darl.algorithms import VARIANTS, Variant
from megatron_darl.loop.config import AlgorithmConfig


@pytest.mark.parametrize("variant", [v.value for v in Variant])
def test_algorithm_presets_match_the_variant_table(variant):
    cfg = load_run_config([f"algorithm={variant}"])
    spec = VARIANTS[Variant(variant)]
    assert isinstance(cfg, RunConfig) and cfg.algorithm.variant == variant
    assert cfg.replay.k == spec.k and cfg.algorithm.max_staleness == spec.eta
    assert cfg.replay.max_replays == spec.max_replays
    assert cfg.algorithm.spec() == spec
    assert cfg.transport.channel.max_staleness == spec.eta  # interpolated, one source of truth


def test_defaults_and_smoke_experiment():
    cfg = load_run_config([])
    assert cfg.algorithm.variant == "darl" and cfg.data.task == "builtin"
    assert cfg.model.needs_warm_start and cfg.sampling.n == cfg.algorithm.group_size
    smoke = load_run_config(["experiment=smoke", "algorithm=sync"])
    assert smoke.cluster.trainer_devices == [] and smoke.cluster.rollout_devices == []
    assert smoke.loop.steps <= 5 and smoke.loop.run_dir == "runs/smoke_sync"
    assert smoke.transport.channel.groups_per_step == smoke.algorithm.groups_per_step == 2


def test_model_group_gives_random_init_shape():
    cfg = load_run_config(["model=qwen3_0.6b"])
    assert cfg.model.hf_config["hidden_size"] == 1024 and not cfg.model.needs_warm_start


@pytest.mark.parametrize("override, field", [
    ("algorithm.variant=ppo", "variant"),
    ("algorithm.mis.backfill=exact", "algorithm.mis.backfill"),
    ("algorithm.score=best", "algorithm.score"),
    ("replay.k=0", "replay.k"),
    ("loop.wandb.mode=cloud", "loop.wandb.mode"),
    ("sampling.n=3", "sampling.n"),
    ("transport.control.num_hubs=2", "num_hubs"),
    ("algorithm.groups_per_step=3", "DP size"),
])
def test_bad_values_name_the_field(override, field):
    extra = ["cluster.trainer_ranks=2", "transport.control.num_hubs=2"] if "DP" in field else []
    with pytest.raises(Exception) as info:
        load_run_config([override, *extra])
    err = info.value
    while err.__cause__ is not None and not isinstance(err, ValueError):
        err = err.__cause__
    assert isinstance(err, ValueError) and field in str(err)


def test_saved_config_reloads_identically(tmp_path):
    cfg = load_run_config(["algorithm=decoupled", "loop.steps=7"])
    path = save_run_config(cfg, tmp_path / "run_config.yaml")
    again = load_run_config(config_file=path)
    assert again == cfg
    child = load_run_config(["worker.worker_id=1", "loop.steps=3"], config_file=path)
    assert child.loop.steps == 3 and child.worker.worker_id == 1 and child.algorithm == cfg.algorithm


def test_algorithm_config_score_override():
    cfg = AlgorithmConfig(variant="darl", score="kl")
    assert cfg.spec().score.value == "kl"
    assert dataclasses.replace(cfg.spec(), score=VARIANTS[Variant.DARL].score) == VARIANTS[Variant.DARL]
