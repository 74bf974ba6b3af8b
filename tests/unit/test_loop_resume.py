"""Resume hand-off through the store: staleness counter, per-worker prompt position, ready flag."""

import pytest

from megatron_darl.loop.resume import (
    mark_ready, prompt_position, seed_store, worker_groups_made,
)
from megatron_darl.rollout.prompts import PromptRecord, PromptSource
from megatron_darl.transport import ControlPlaneConfig, serve_store
from megatron_darl.transport.store import Keys, TransportTimeout
from tests.distributed.procs.launcher import free_port


def test_prompt_position_matches_the_source_after_n_prompts():
    records = [PromptRecord(i, (1, 2, i)) for i in range(10)]
    for made in (0, 3, 4, 11):
        walked = PromptSource(records, shard=1, num_shards=3, seed=5)
        for _ in range(made):
            walked.next()
        resumed = PromptSource(records, shard=1, num_shards=3, seed=5)
        resumed.load_state_dict(prompt_position(made, len(range(1, 10, 3))))
        assert [resumed.next().prompt_id for _ in range(5)] == [walked.next().prompt_id for _ in range(5)]
    with pytest.raises(ValueError, match="shard_size"):
        prompt_position(3, 0)


def test_store_seeding_and_ready_handshake():
    store = serve_store(ControlPlaneConfig(port=free_port(), store_timeout_s=10))
    with pytest.raises(TransportTimeout):
        worker_groups_made(store, 0, timeout_s=0.2)  # no trainer yet: a named timeout, no hang
    store.add(Keys.STARTED, 3)  # whatever a fresh start left there is replaced
    seed_store(store, groups_received=12, worker_groups=[7, 5])
    mark_ready(store)
    assert worker_groups_made(store, 0, 1.0) == 7 and worker_groups_made(store, 1, 1.0) == 5
    assert worker_groups_made(store, 2, 1.0) == 0  # a worker the checkpoint never heard of
    assert store.add(Keys.STARTED, 1) == 13  # the staleness counter continues
