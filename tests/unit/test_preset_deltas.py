"""Defaults live once, in the run schema: a preset states only what it changes.

``configs/rollout/*.yaml`` write only how their engine differs from ``RunConfig``'s defaults
(``engine.backend`` names the engine in each); ``configs/cluster/gpu4.yaml`` and ``gpu8.yaml``
write only the two GPU counts, from which ``launch.config.apply_gpu_counts`` derives ranks,
workers and device lists.
"""

from omegaconf import OmegaConf

from launch.config import CONFIG_DIR, load_run_config
from megatron_darl.loop.run_config import RunConfig


def _flat(node, prefix=""):
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_rollout_presets_state_only_what_differs_from_the_schema():
    schema = _flat(OmegaConf.to_container(OmegaConf.structured(RunConfig)))
    for preset in ("hf", "vllm"):
        stated = _flat(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"rollout/{preset}.yaml")))
        assert stated["engine.backend"] == preset
        repeated = {k: v for k, v in stated.items() if k != "engine.backend" and schema[k] == v}
        assert not repeated, f"configs/rollout/{preset}.yaml repeats schema defaults: {repeated}"


def test_hf_and_vllm_runs_differ_only_in_the_engine_and_groups_in_flight():
    hf, vllm = (_flat(OmegaConf.to_container(OmegaConf.structured(load_run_config([f"rollout={p}"]))))
                for p in ("hf", "vllm"))
    assert {k for k in hf if hf[k] != vllm[k]} == {
        "engine.backend", "engine.dtype", "engine.max_batch_size", "worker.max_inflight"}


def test_gpu_count_presets_state_only_the_two_counts():
    for preset, (t, r) in (("gpu4", (2, 2)), ("gpu8", (4, 4))):
        node = OmegaConf.load(CONFIG_DIR / f"cluster/{preset}.yaml")
        assert dict(node) == {"trainer_gpus": t, "rollout_gpus": r}
        c = load_run_config([f"cluster={preset}"]).cluster
        assert (c.trainer_ranks, c.rollout_workers) == (t, r)
        assert (c.trainer_devices, c.rollout_devices) == (list(range(t)), list(range(t, t + r)))
