"""Fixtures: a real two-node Slurm cluster (started for the slurm tier, stopped after it by PID)
and the warm-started tiny policy the CPU jobs train."""

from __future__ import annotations

import os

import pytest

from local_cluster import LocalSlurm, missing_binaries


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)}); tests/run.sh installs it as root")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def warm_policy() -> str:
    """The embedded default's warm-started tiny policy (HF dir), fitted here once if not cached,
    so no job spends its time limit fitting it."""
    from launch.warmstart import ensure_warm_policy
    from megatron_darl.models.config import WarmStartConfig

    return str(ensure_warm_policy(WarmStartConfig(), log=lambda m: None))


@pytest.fixture(autouse=True)
def _no_job_left_behind(request):
    """After a test that used the cluster, cancel whatever it left queued or running (a failed
    test must not hold the nodes the next test needs)."""
    yield
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster").cancel_all()
