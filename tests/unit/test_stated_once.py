"""Each number several components share is stated once: in no YAML file and in no config dataclass
a second time, and never copied by interpolation. The staleness bound (eta, B), the group size G
and the topology (workers, hubs, stages) have one home key each; the transport, the worker and
the loop take the plain values ``RunConfig.bound`` and ``RunConfig.topology`` derive from them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from launch.config import load_run_config
from megatron_darl.loop.run_config import RunConfig
from megatron_darl.transport import StalenessBound, Topology

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# the six shared numbers: their one home key, and every other name a copy of them would go by
HOMES = {
    "algorithm.max_staleness": ("max_staleness", "eta"),
    "algorithm.groups_per_step": ("groups_per_step",),
    "algorithm.group_size": ("group_size", "sampling.n"),
    "cluster.rollout_workers": ("rollout_workers", "num_workers"),
    "cluster.trainer_ranks / (parallel.tp x parallel.pp)": ("num_hubs", "dp_size"),
    "parallel.pp": ("num_stages",),
}
INTERPOLATED = re.compile(r"\$\{[^}]*(max_staleness|groups_per_step|group_size|rollout_workers|trainer_ranks|"
                          r"parallel\.pp|dp_size)")


def _copies(key: str) -> list[str]:
    """The shared numbers ``key`` (a dotted path) would state a second time."""
    leaf = key.rsplit(".", 1)[-1]
    return [home for home, names in HOMES.items()
            if key != home and any(n == key or ("." not in n and n == leaf) for n in names)]


def _leaves(node, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def _yaml_keys(path: Path):
    """(dotted key in the composed config, value) of one config file."""
    text = path.read_text()
    group = path.parent.relative_to(CONFIGS).parts
    prefix = "" if not group or "@package _global_" in text else ".".join(group) + "."
    data = yaml.safe_load(text) or {}
    data.pop("defaults", None)
    for key, value in _leaves(data):
        yield prefix + key, value


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_no_yaml_states_a_shared_number_twice(path):
    for key, value in _yaml_keys(path):
        assert not _copies(key), f"{path.relative_to(CONFIGS)}: {key} restates {_copies(key)}"
        assert not (isinstance(value, str) and INTERPOLATED.search(value)), \
            f"{path.relative_to(CONFIGS)}: {key}: {value!r} copies a shared number"


def _fields(cls, prefix: str = ""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _fields(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_no_config_dataclass_states_a_shared_number_twice():
    keys = list(_fields(RunConfig))
    assert [k for k in keys if _copies(k)] == []
    for home in ("algorithm.max_staleness", "algorithm.groups_per_step", "algorithm.group_size",
                 "cluster.rollout_workers", "cluster.trainer_ranks", "parallel.pp"):
        assert home in keys  # the one place each is stated


def test_the_copy_check_finds_a_copy():
    assert _copies("transport.channel.max_staleness") == ["algorithm.max_staleness"]
    assert _copies("transport.control.num_hubs") and _copies("sampling.n") and _copies("x.num_stages")
    assert not _copies("eval.n") and not _copies("algorithm.group_size")


@pytest.mark.parametrize("overrides, bound, topology", [
    ([], (2, 8), (1, 1, 1)),
    (["experiment=smoke", "algorithm=sync"], (0, 2), (1, 1, 1)),
    (["cluster=gpu4", "cluster.split=3:1", "algorithm.groups_per_step=12"], (2, 12), (1, 3, 1)),
    (["cluster.trainer_ranks=4", "parallel.pp=2", "cluster.rollout_workers=3"], (2, 8), (3, 2, 2)),
])
def test_bound_and_topology_derive_from_the_home_keys(overrides, bound, topology):
    cfg = load_run_config(overrides)
    assert cfg.bound == StalenessBound(*bound) and cfg.topology == Topology(*topology)


def test_the_bound_s_capacity():
    bound = StalenessBound(max_staleness=2, groups_per_step=8)
    assert bound.window == 24 and bound.capacity(3) == 48  # (t + eta + 1) * B
    assert StalenessBound(max_staleness=0, groups_per_step=5).window == 5  # synchronous: one step's B
    with pytest.raises(ValueError, match="groups_per_step"):
        StalenessBound(max_staleness=0, groups_per_step=0)
