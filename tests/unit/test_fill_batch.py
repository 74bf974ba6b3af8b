"""Dynamic sampling (``replay.fill_batch``, DAPO's filter groups): a group whose rewards are all
equal is dropped where groups enter the trainer, its start given back to the staleness ledger
under its own counter (never ``refused``/``dropped``), only trainable groups count toward a
step's B, a step whose wait dropped ``fill_max_degenerate`` goes on with what it has, and the
combination with ``replay.drop_degenerate=false`` is refused before launch (real ledger, real
store; the hub is a stand-in that hands out prepared groups)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_darl.algorithms import rewards_equal
from megatron_darl.loop.endpoints import Backlog, ProgressWatch, TrainerEndpoints, receive_groups
from megatron_darl.loop.metrics import step_metrics
from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.step.config import ReplayConfig
from megatron_darl.step.stats import StepStats
from megatron_darl.transport import StalenessBound, StalenessGate
from megatron_darl.transport.staleness import (
    give_back_degenerate, groups_dropped, groups_refused, mark_delivered, release_reservations,
)
from megatron_darl.transport.store import Keys

REPO = Path(__file__).resolve().parents[2]


def _group(group_id: int, rewards: list[float], version: int = 0, worker: int = 0) -> SampleGroup:
    samples = [Sample(sample_id=group_id * 100 + i, prompt_ids=torch.tensor([1]), response_ids=torch.tensor([5, 6]),
                      behavior_logprobs=torch.zeros(2), token_versions=torch.full((2,), version), reward=r)
               for i, r in enumerate(rewards)]
    return SampleGroup(group_id=group_id, prompt_id=group_id, samples=samples, worker_id=worker,
                       worker_index=group_id)


def test_rewards_equal_is_the_advantage_rule():
    assert rewards_equal(torch.tensor([1.0, 1.0, 1.0])) and rewards_equal(torch.tensor([0.5]))
    assert not rewards_equal(torch.tensor([0.0, 1.0])) and not rewards_equal(torch.tensor([]))


def test_a_degenerate_group_gives_its_start_back_under_its_own_key(stores):
    server, client = stores
    gate = StalenessGate(client, StalenessBound(max_staleness=0, groups_per_step=2), worker_id=0)
    assert len(gate.try_start_batch(2)) == 2 and gate.try_start() is None  # the bound: 2 at version 0
    assert mark_delivered(server, 0, 2, generation=gate.generation)
    assert give_back_degenerate(server, [_group(1, [1.0, 1.0])]) == 1
    assert give_back_degenerate(server, []) == 0  # nothing to give back: no request
    assert gate.started() == 1 and gate.try_start() is not None  # room for a replacement
    assert groups_refused(server) == {"fenced": 0, "stale": 0, "degenerate": 1} and groups_dropped(server) == 0
    # the worker is then declared lost: its delivered groups were not outstanding, nothing more comes back
    assert release_reservations(server, 0) == 1  # only the replacement it reserved and never delivered
    assert server.add(Keys.STARTED, 0) == 1 and groups_dropped(server) == 1
    with pytest.raises(ValueError, match="unknown reason 'late'"):
        server.ledger.call("refuse", count=1, why="late")


def test_a_fenced_generations_group_gains_nothing(stores):
    server, client = stores
    gate = StalenessGate(client, StalenessBound(max_staleness=0, groups_per_step=2), worker_id=0)
    assert len(gate.try_start_batch(2)) == 2
    assert release_reservations(server, 0) == 2  # declared lost: both starts given back
    assert not mark_delivered(server, 0, 1, generation=1)  # its group arrives later: refused at the hub,
    assert server.add(Keys.STARTED, 0) == 0  # never handed on to the degenerate filter, no second give-back
    assert groups_refused(server) == {"fenced": 1, "stale": 0, "degenerate": 0}


class _Hub:
    """Hands out one prepared batch of groups per poll (a stand-in for ``SampleHub``)."""

    def __init__(self, batches: list[list[SampleGroup]]) -> None:
        self.batches, self.hub = list(batches), 0

    def poll(self):
        return [SimpleNamespace(group=g) for g in (self.batches.pop(0) if self.batches else [])]


def _endpoints(store, batches, max_staleness: int = 4) -> TrainerEndpoints:
    hb = SimpleNamespace(is_lost=lambda *a: False, is_alive=lambda *a: True, incarnations=lambda *a: 1)
    return TrainerEndpoints(store=store, heartbeat=hb, hub=_Hub(batches), sender=None, me=None,
                            bound=StalenessBound(max_staleness=max_staleness, groups_per_step=1))


def _receive(ep, need, max_degenerate, rank=0):
    ps = SimpleNamespace(rank=rank, dp_sum=lambda t: t)
    return receive_groups(ep, ps, need, timeout_s=5.0, step=2, poll_s=0.0, num_workers=1,
                          max_degenerate=max_degenerate)


def test_only_trainable_groups_count_toward_b_and_every_drop_is_given_back(stores):
    server, _ = stores
    server.add(Keys.STARTED, 7)  # the groups below were started
    batches = [[_group(1, [1.0, 1.0]), _group(2, [0.0, 1.0])], [_group(3, [0.0, 0.0]), _group(4, [1.0, 0.0])],
               [_group(5, [0.0, 1.0])]]
    got = _receive(_endpoints(server, batches), need=2, max_degenerate=10)
    assert [g.group_id for g in got.groups] == [2, 4] and got.total == 2 and not got.short
    assert [g.group_id for g in got.degenerate] == [1, 3]
    assert server.add(Keys.STARTED, 0) == 5 and groups_refused(server)["degenerate"] == 2
    # off: the same arrivals all count, none is given back
    off = _receive(_endpoints(server, [[_group(11, [1.0, 1.0]), _group(12, [0.0, 1.0])]]), need=2,
                   max_degenerate=None)
    assert off.total == 2 and not off.degenerate and groups_refused(server)["degenerate"] == 2


def test_a_stale_group_is_refused_as_stale_before_the_filter_sees_it(stores):
    server, _ = stores
    server.add(Keys.STARTED, 2)
    got = _receive(_endpoints(server, [[_group(1, [1.0, 1.0], version=0), _group(2, [0.0, 1.0], version=2)]],
                              max_staleness=1), need=1, max_degenerate=10)  # step 2: version 0 is 2 old
    assert [g.group_id for g in got.groups] == [2] and not got.degenerate
    assert groups_refused(server) == {"fenced": 0, "stale": 1, "degenerate": 0}


def test_a_task_the_policy_cannot_learn_ends_the_wait_with_one_warning(stores, caplog):
    server, _ = stores
    server.add(Keys.STARTED, 5)
    batches = [[_group(i, [0.0, 0.0])] for i in range(5)]
    with caplog.at_level(logging.WARNING):
        got = _receive(_endpoints(server, batches), need=4, max_degenerate=3)
    assert got.short and got.total == 0 and len(got.degenerate) == 3
    lines = [r.getMessage() for r in caplog.records if "degenerate groups dropped" in r.getMessage()]
    assert len(lines) == 1 and "replay.fill_max_degenerate=3" in lines[0] and "0 of 4 trainable" in lines[0]
    backlog = Backlog(per_step=4)
    backlog.took(got.total)  # a short step leaves no debt: the next one waits for B again
    assert backlog.need() == 4


def test_the_timeout_says_groups_arrived_but_all_were_degenerate(stores):
    server, _ = stores
    watch = ProgressWatch(_endpoints(server, []), num_workers=1, timeout_s=0.01, step=7, need=4)
    watch.states = lambda: "rollout 0: alive"
    assert watch.check(0, 5) == ""  # arrivals, dropped or not, show the rollout side is alive
    time.sleep(0.05)
    why = watch.check(0, 5)
    assert why.startswith("trainer step 7: 0/4 groups (5 arrived, all degenerate: equal rewards, dropped by "
                          "replay.fill_batch); no new group for"), why


def test_the_step_metrics_count_the_drops_and_keep_the_reward_of_all_that_arrived():
    stats = StepStats.empty(2)
    stats.groups_received, stats.samples_received, stats.reward_sum = 2, 4, 2.0
    stats.groups_degenerate, stats.samples_degenerate, stats.reward_sum_degenerate = 6, 12, 12.0
    out = step_metrics(stats)
    assert out["groups_degenerate"] == 6 and out["degenerate_share"] == 0.75
    assert out["reward_mean"] == 14.0 / 16 and out["groups_received"] == 2


def test_the_config_refuses_fill_without_dropping_and_resolves_its_guard():
    with pytest.raises(ValueError, match=r"replay.fill_batch=true needs replay.drop_degenerate=true"):
        ReplayConfig(fill_batch=True, drop_degenerate=False)
    with pytest.raises(ValueError, match=r"replay.fill_max_degenerate must be >= 1"):
        ReplayConfig(fill_batch=True, fill_max_degenerate=0)
    assert ReplayConfig().max_degenerate(16) is None  # off by default
    assert ReplayConfig(fill_batch=True).max_degenerate(16) == 160
    assert ReplayConfig(fill_batch=True, fill_max_degenerate=7).max_degenerate(16) == 7


def test_launch_refuses_the_combination_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launch.train", "experiment=smoke", "replay.fill_batch=true",
                           "replay.drop_degenerate=false", f"loop.run_dir={run_dir}"], cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, lines)
    assert "replay.fill_batch" in lines[0] and "replay.drop_degenerate" in lines[0]
    assert not run_dir.exists()


def test_a_surplus_group_that_expires_untrained_is_no_longer_counted_for_the_next_step():
    """Naive async trains the freshest first: a group received beyond B waits while two new ones
    arrive each step, ages out of the window untrained, and the next step must wait for B new
    ones, not B minus a group that is gone (it trained 1 of 2 in a CI run)."""
    from megatron_darl.step.config import AlgorithmConfig
    from megatron_darl.step.planner import ShardPlanner
    from tests.unit.test_step_planner import fake_logprobs, make_group

    planner = ShardPlanner(AlgorithmConfig(variant="async", groups_per_step=2, max_staleness=2),
                           ReplayConfig(k=3, max_replays=1))
    backlog = Backlog(per_step=2)
    arrivals = [[make_group(1, 0), make_group(2, 0), make_group(3, 0)],  # one beyond B
                [make_group(4, 1), make_group(5, 1)], [make_group(6, 2), make_group(7, 2)]]
    untrained = []
    for step, groups in enumerate(arrivals):
        backlog.took(len(groups))
        plan = planner.step(groups, step, step, fake_logprobs)
        assert plan.stats.groups_selected == 2
        planner.evict(step + 1, plan.stats)
        backlog.keep_at_most(int(plan.stats.groups_untrained))
        untrained.append((int(plan.stats.groups_untrained), step_metrics(plan.stats)["buffer_untrained"]))
    assert untrained == [(1, 1.0), (1, 1.0), (0, 0.0)]  # the version-0 leftover left the window at version 3
    assert backlog.need() == 2
    assert Backlog(per_step=2, surplus=1).need() == 1  # without the cap: one group, and a step of 1


def test_the_cap_leaves_the_bound_counted_need_alone():
    """With ``loop.wait_for_bound`` the surplus counts starts against the bound, which an expired
    group does not give back: no replacement could come, so the need stays."""
    backlog = Backlog(per_step=8, ahead=3, surplus=24)
    backlog.keep_at_most(0)
    assert (backlog.surplus, backlog.need()) == (24, 8)
