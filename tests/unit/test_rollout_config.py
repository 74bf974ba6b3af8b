"""configs/rollout/*.yaml state only fields of the typed configs they compose (the rest is their default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_darl.rollout.config import EngineConfig, ResponseSamplingConfig, RolloutWorkerConfig
from megatron_darl.transport import (
    ChannelConfig, ControlPlaneConfig, HeartbeatConfig, TransportConfig, WeightSyncConfig,
)

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "rollout").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_rollout_yaml_builds_the_dataclasses(path):
    d = yaml.safe_load(path.read_text())  # a preset states only what differs from the defaults
    t = d.get("transport", {})
    cfg = TransportConfig(ControlPlaneConfig(**t.get("control", {})), HeartbeatConfig(**t.get("heartbeat", {})),
                          ChannelConfig(**t.get("channel", {})), WeightSyncConfig(**t.get("weight_sync", {})))
    engine = EngineConfig(**d["engine"])
    ResponseSamplingConfig(**d.get("sampling", {}))
    RolloutWorkerConfig(**d.get("worker", {}))
    assert engine.backend == path.stem and cfg.heartbeat.timeout_s > 2 * cfg.heartbeat.interval_s


def test_worker_config_rejects_bad_values():
    with pytest.raises(ValueError, match="worker_id"):
        RolloutWorkerConfig(worker_id=-1)
    with pytest.raises(ValueError, match="backend"):
        WeightSyncConfig(backend="mpi")
