"""Hydra composition into the typed RunConfig: presets, the variant table, validation, round trip."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from launch.config import RunConfig, load_run_config, save_run_config
from megatron_darl.algorithms import VARIANTS, RatioBase, Variant, WeightRule
from megatron_darl.loop.config import density_temperature
from megatron_darl.step.config import AlgorithmConfig

REPO = Path(__file__).resolve().parents[2]

# (K, eta, max replays) of each preset: stated once, in configs/algorithm/<variant>.yaml
PRESET_WINDOWS = {"sync": (1, 0, 1), "async": (3, 2, 1), "decoupled": (3, 2, 1), "darl": (4, 2, None),
                  "darl_nofilter": (4, 2, None), "darl_nomis": (4, 2, None)}


@pytest.mark.parametrize("variant", [v.value for v in Variant])
def test_algorithm_presets_match_the_variant_table(variant):
    cfg = load_run_config([f"algorithm={variant}"])
    spec = VARIANTS[Variant(variant)]
    assert isinstance(cfg, RunConfig) and cfg.algorithm.variant == variant
    k, eta, replays = PRESET_WINDOWS[variant]
    assert (cfg.replay.k, cfg.algorithm.max_staleness, cfg.replay.max_replays) == (k, eta, replays)
    assert eta <= k - 1  # arriving samples are always inside the window
    assert cfg.algorithm.spec() == spec
    assert cfg.bound.max_staleness == eta and cfg.bound.groups_per_step == cfg.algorithm.groups_per_step


def test_max_staleness_and_b_are_stated_once():
    """The bound the transport enforces is the algorithm's: the rollout presets state neither."""
    cfg = load_run_config(["algorithm=darl", "algorithm.max_staleness=3", "algorithm.groups_per_step=4",
                           "worker.groups_per_batch=4"])
    assert (cfg.bound.max_staleness, cfg.bound.groups_per_step, cfg.bound.window) == (3, 4, 16)
    for name in ("hf", "vllm"):
        text = (REPO / "configs" / "rollout" / f"{name}.yaml").read_text()
        assert "max_staleness" not in text and "groups_per_step" not in text, name


def test_defaults_and_smoke_experiment():
    cfg = load_run_config([])
    assert cfg.algorithm.variant == "darl" and cfg.data.task == "builtin"
    assert cfg.model.needs_warm_start and cfg.algorithm.group_size == 8
    smoke = load_run_config(["experiment=smoke", "algorithm=sync"])
    assert smoke.cluster.trainer_devices == [] and smoke.cluster.rollout_devices == []
    assert smoke.loop.steps <= 5 and smoke.loop.run_dir.startswith("runs/smoke_sync_20")  # timestamped
    assert smoke.bound.groups_per_step == smoke.algorithm.groups_per_step == 2


def test_model_group_gives_random_init_shape():
    cfg = load_run_config(["model=qwen3_0.6b"])
    assert cfg.model.hf_config["hidden_size"] == 1024 and not cfg.model.needs_warm_start


@pytest.mark.parametrize("override, field", [
    ("algorithm.variant=ppo", "variant"),
    ("algorithm.mis.backfill=exact", "algorithm.mis.backfill"),
    ("algorithm.score=best", "algorithm.score"),
    ("replay.k=0", "replay.k"),
    ("loop.wandb.mode=cloud", "loop.wandb.mode"),
    ("algorithm.groups_per_step=1", "DP size"),  # 2 DP ranks need 2 groups a step
    ("algorithm.ppo_minibatches=0", "algorithm.ppo_minibatches"),
    ("algorithm.ppo_epochs=0", "algorithm.ppo_epochs"),
    ("algorithm.mis.cap_mode=cut", "algorithm.mis.cap_mode"),
    ("algorithm.mis.form=both", "algorithm.mis.form"),
    ("algorithm.rollout_is=2.0", "algorithm.rollout_is"),  # darl: its weight already is the IS
    ("sampling.top_p=0.9", "sampling.top_p"),
    ("sampling.top_k=20", "sampling.top_k"),
])
def test_bad_values_name_the_field(override, field):
    extra = ["cluster.trainer_ranks=2"] if "DP" in field else []
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


@pytest.mark.parametrize("preset, variant", [
    ("darl_paper", "darl"), ("async_paper", "async"), ("decoupled_paper", "decoupled"),
    ("async_is_paper", "async")])
def test_paper_presets_one_step_off_window_warmup_minibatches(preset, variant):
    cfg = load_run_config([f"algorithm={preset}"])
    a = cfg.algorithm
    assert (a.variant, a.max_staleness, cfg.replay.k, cfg.replay.warmup) == (variant, 1, 4, 5)
    assert (a.ppo_minibatches, a.ppo_epochs, a.optimizer_steps) == (4, 1, 4)
    assert a.weight_cap == 2.0 and a.mis.cap_mode == "clip"
    assert cfg.bound.max_staleness == 1
    assert cfg.replay.max_replays == (None if variant == "darl" else 1)
    assert a.rollout_is == (2.0 if preset == "async_is_paper" else None)


def test_rollout_is_turns_async_into_ratio_against_pi_t_with_capped_weights():
    cfg = load_run_config(["algorithm=async_is_paper"])
    spec = cfg.algorithm.spec()
    assert (spec.weight_rule, spec.ratio_base) == (WeightRule.OWN_BEHAVIOR, RatioBase.PROXIMAL)
    assert spec.score is VARIANTS[Variant.ASYNC].score
    # the same objective as decoupled PPO: verl's name for it
    decoupled = load_run_config(["algorithm=decoupled_paper"]).algorithm.spec()
    assert (spec.weight_rule, spec.ratio_base, spec.score) == (
        decoupled.weight_rule, decoupled.ratio_base, decoupled.score)
    plain = load_run_config(["algorithm=async_paper"]).algorithm
    assert plain.spec() == VARIANTS[Variant.ASYNC] and plain.weight_cap == plain.mis.clip
    sync = AlgorithmConfig(variant="sync", max_staleness=0, rollout_is=3.0)
    assert sync.spec().weight_rule is WeightRule.OWN_BEHAVIOR and sync.weight_cap == 3.0


def test_density_temperature():
    assert density_temperature(0.7, 1.0, -1) == 0.7
    assert density_temperature(0.0, 1.0, -1) == 1.0  # greedy reports temperature-1 log-probs
    assert density_temperature(1.0, 1.0, 0) == 1.0  # top_k 0 is "off" too
    with pytest.raises(ValueError, match="sampling.temperature"):
        density_temperature(-1.0, 1.0, -1)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_missing_vllm_is_refused_before_launch_in_one_line():
    from launch.preflight import check_engine

    with pytest.raises(ValueError) as err:
        check_engine(load_run_config(["rollout=vllm"]))
    line = str(err.value)
    assert "\n" not in line and "pip install -e .[vllm]" in line and "rollout=hf" in line
    check_engine(load_run_config(["rollout=hf"]))  # hf needs nothing more
