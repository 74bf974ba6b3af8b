"""Every config group ``python -m launch.train --help`` lists is selectable as written
(``GROUP=PRESET``), and the old spelling of the rollout group still composes the same run."""

from omegaconf import OmegaConf

from launch.config import canonical_override, compose, load_run_config
from launch.train import config_groups, usage

GROUPS = config_groups()
CASES = [(g, p) for g, presets in GROUPS.items() for p in presets]


def test_help_lists_the_groups_of_the_defaults_list_only():
    assert set(GROUPS) == {"algorithm", "cluster", "data", "experiment", "model", "rollout", "trainer"}
    text = usage()
    assert "  rollout    hf | vllm" in text and "\n  eval " not in text  # configs/eval/ is tools/eval.py's table


def test_every_listed_preset_composes_as_written():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from launch.config import CONFIG_DIR, register_schema, to_run_config

    register_schema()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):  # one Hydra start for all
        nodes = {(g, p): hydra_compose(config_name="config", overrides=[f"{g}={p}"]) for g, p in CASES}
    for (group, preset), node in nodes.items():
        if group == "rollout":
            assert to_run_config(node).engine.backend == preset
        if group == "algorithm":
            assert node.algorithm.variant == _declared_variant(CONFIG_DIR / "algorithm", preset)
        if group == "data":
            assert node.data == OmegaConf.merge(node.data, OmegaConf.load(CONFIG_DIR / f"data/{preset}.yaml"))


def _declared_variant(folder, preset: str) -> str:
    """The variant a preset file sets, or the one of the preset it builds on (its defaults)."""
    node = OmegaConf.load(folder / f"{preset}.yaml")
    if "algorithm" in node and "variant" in node.algorithm:
        return node.algorithm.variant
    parent = next(d for d in node.defaults if d != "_self_")
    return _declared_variant(folder, parent)


def test_old_rollout_spelling_is_the_same_run():
    assert canonical_override("rollout@_global_=vllm") == "rollout=vllm"
    assert canonical_override("loop.run_dir=a@_global_=b") == "loop.run_dir=a@_global_=b"
    old = OmegaConf.to_yaml(compose(["rollout@_global_=vllm", "algorithm=sync"]))
    assert old == OmegaConf.to_yaml(compose(["rollout=vllm", "algorithm=sync"]))
    assert "backend: vllm" in old


def test_slurm_engine_knob_uses_the_group_name_and_respects_the_users_choice():
    from launch.slurm import _groups

    assert _groups(["rollout@_global_=hf", "model.path=x"]) == {"rollout"}
    assert _groups(["rollout=hf"]) == {"rollout"}


def test_records_read_the_engine_from_either_spelling():
    from tools.scaling_records import record_engine

    assert record_engine({"overrides": ["rollout=vllm"]}) == "vllm"
    assert record_engine({"overrides": ["rollout@_global_=vllm"]}) == "vllm"
    assert record_engine({"overrides": ["algorithm=sync"]}) == "hf"
