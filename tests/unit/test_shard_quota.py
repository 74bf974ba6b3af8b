"""A step's B groups split over DP shards as evenly as they go, so a DP size that does not divide B
(32 groups on 3 trainer GPUs) trains exactly B groups a step and is a valid split (the planners'
side: tests/unit/test_step_planner.py, test_shards_take_their_quota_and_share_alpha)."""

import pytest

from launch.config import load_run_config
from megatron_darl.samples import shard_quota


def test_quotas_split_b_as_evenly_as_it_goes():
    assert [shard_quota(32, 3, s) for s in range(3)] == [11, 11, 10]
    assert [shard_quota(8, 2, s) for s in range(2)] == [4, 4]
    assert sum(shard_quota(29, 4, s) for s in range(4)) == 29
    with pytest.raises(ValueError, match="2 groups a step cannot give each of 3 DP shards one"):
        shard_quota(2, 3, 0)
    with pytest.raises(ValueError, match="shard 3 outside 0..2"):
        shard_quota(32, 3, 3)


def test_a_batch_smaller_than_the_dp_size_is_refused_before_launch():
    with pytest.raises(ValueError, match="groups_per_step=2 must be at least the DP size 3"):
        load_run_config(["cluster=gpu4", "cluster.split=3:1", "algorithm.groups_per_step=2",
                         "worker.groups_per_batch=2"])
    cfg = load_run_config(["cluster=gpu4", "cluster.split=3:1", "algorithm.groups_per_step=32",
                           "worker.groups_per_batch=32"])
    assert cfg.topology.hubs == 3
