"""Fixtures shared by unit tests of the staleness ledger and its users."""

import pytest

from megatron_darl.transport import ControlPlaneConfig, connect_store, serve_store
from tests.distributed.procs.launcher import free_port


@pytest.fixture
def control():
    """The control plane of a run with a secret, on a free port."""
    return ControlPlaneConfig(port=free_port(), store_timeout_s=10, call_timeout_s=5, secret="run-secret")


@pytest.fixture
def stores(control):
    """A run's store server with its ledger (one rollout worker) and a worker's client to it."""
    server = serve_store(control)
    client = connect_store(control, who="rollout 0")
    yield server, client
    client.close()
    server.close()
