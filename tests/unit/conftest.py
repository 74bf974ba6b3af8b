"""Fixtures shared by unit tests of the staleness ledger's users."""

import pytest

from megatron_darl.transport import ControlPlaneConfig, connect_store, serve_store
from tests.distributed.procs.launcher import free_port


@pytest.fixture
def stores():
    """A run's store server with its ledger (one rollout worker) and a worker's client to it."""
    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10, call_timeout_s=5,
                                 secret="run-secret")
    server = serve_store(control)
    client = connect_store(control, who="rollout 0")
    yield server, client
    client.close()
    server.close()
