"""Fixture: a real two-node Slurm cluster started for the slurm tier and stopped after it."""

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
