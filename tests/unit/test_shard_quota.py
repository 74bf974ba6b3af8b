"""A step's B groups split over DP shards as evenly as they go, so a DP size that does not divide B
(32 groups on 3 trainer GPUs) trains exactly B groups a step and is a valid split."""

import threading

import pytest
import torch

from launch.config import load_run_config
from megatron_darl.step.config import ReplayConfig
from megatron_darl.samples import shard_of, shard_quota
from megatron_darl.step.planner import ShardPlanner
from test_step_planner import ThreadSum, algo, fake_logprobs, make_group


def test_quotas_split_b_as_evenly_as_it_goes():
    assert [shard_quota(32, 3, s) for s in range(3)] == [11, 11, 10]
    assert [shard_quota(8, 2, s) for s in range(2)] == [4, 4]
    assert sum(shard_quota(29, 4, s) for s in range(4)) == 29
    with pytest.raises(ValueError, match="2 groups a step cannot give each of 3 DP shards one"):
        shard_quota(2, 3, 0)
    with pytest.raises(ValueError, match="shard 3 outside 0..2"):
        shard_quota(32, 3, 3)


def test_three_shards_train_exactly_b_groups_with_one_alpha():
    b = 5
    planners = [ShardPlanner(algo("darl", b=b), ReplayConfig(k=4), shard=i, num_shards=3) for i in range(3)]
    assert [p.quota for p in planners] == [2, 2, 1]
    groups = [make_group(g, g % 3) for g in range(1, 31)]
    dp, plans = ThreadSum(3), [None] * 3

    def run(i):
        mine = [g for g in groups if shard_of(g.group_id, 3) == i]
        plans[i] = planners[i].step(mine, 2, 2, fake_logprobs, exact_versions=[0, 1], dp_sum=dp)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert [len(pl.selection.entries) for pl in plans] == [2, 2, 1]
    total = sum(pl.selection.version_tokens for pl in plans)
    assert torch.equal(sum(dp.parts), total) and all(torch.isfinite(pl.loss_inputs.weights).all() for pl in plans)


def test_a_batch_smaller_than_the_dp_size_is_refused_before_launch():
    with pytest.raises(ValueError, match="groups_per_step=2 must be at least the DP size 3"):
        load_run_config(["cluster=gpu4", "cluster.split=3:1", "algorithm.groups_per_step=2",
                         "worker.groups_per_batch=2"])
    cfg = load_run_config(["cluster=gpu4", "cluster.split=3:1", "algorithm.groups_per_step=32",
                           "worker.groups_per_batch=32"])
    assert cfg.transport.control.num_hubs == 3
