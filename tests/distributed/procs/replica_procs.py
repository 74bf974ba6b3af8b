"""Worker body of ``test_loop_replica.py``: the loop's step with the replay state on the hub only.

Each rank builds the trainer at the given TP x PP (one DP replica) and runs ``STEPS`` steps of
the real ``StepRunner`` (darl, K = 4, 2 PPO mini-batches, exact snapshot backfill). Only the hub
(TP 0, first stage) holds a ``ShardPlanner``; it alone makes the groups of each step (behavior
log-probs = its own pass + noise, arriving ``group_id % 3`` steps late), so the peers see no
sample data except the batches the hub broadcasts. Before each step the hub "waits" with the
step's first group in and computes what the step will need (``StepRunner.prefetch``), which its
peers serve (``follow_wait``). Recorded per step: the full HF-named weights
(rank 0), the trainer's loss, and per rank whether it held a planner and how many passes it ran.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

GROUPS, GROUP_SIZE, K, ETA, STEPS = 4, 4, 4, 2, 4


def replica_worker(rank: int, world_size: int, tp: int, pp: int, hf_dir: str, out_path: str) -> None:
    from megatron_darl.step.config import AlgorithmConfig, ReplayConfig
    from megatron_darl.step.planner import ShardPlanner
    from megatron_darl.step.runner import StepRunner
    from resume_procs import generate, tiny_trainer
    from trainer_procs import gather_hf_params

    algo = AlgorithmConfig(variant="darl", groups_per_step=GROUPS, group_size=GROUP_SIZE,
                           max_staleness=ETA, ppo_minibatches=2)
    replay = ReplayConfig(k=K)
    trainer, ps = tiny_trainer(hf_dir, tp, pp)
    hub = ps.tp_rank == 0 and ps.pp_rank == 0
    planner = ShardPlanner(algo, replay) if hub else None
    runner = StepRunner(algo, replay, planner, trainer, ps)
    passes = []
    inner = runner.logprobs
    runner.logprobs = lambda batch, version: passes.append((trainer.version, version)) or inner(batch, version)
    trainer.snapshot(keep=replay.window.versions(trainer.version))
    made, out = {}, {"params": {}, "loss": {}, "backfill": {}}
    for step in range(STEPS):
        arrivals = []
        if hub:  # the groups exist on the hub only
            made[step] = generate(trainer, step, runner.replica_logprobs)
            arrivals = [g for s, lst in made.items() for g in lst if s + g.group_id % 3 == step]
        if hub:  # the wait: the first arrival is in, the hub computes what the step will need
            while runner.prefetch(arrivals[:1], step):
                pass
            runner.end_wait(False, False)
        else:
            assert runner.follow_wait() == (False, False)
        plan, result = runner.run(arrivals, step)
        if hub:
            planner.evict(trainer.version, plan.stats)
            out["backfill"][step] = plan.stats.backfill_snapshot + plan.stats.rows_prefetched
        out["loss"][step] = result.loss
        out["params"][step] = gather_hf_params(trainer, ps)
    mine = {"rank": rank, "hub": hub, "planner": planner is not None, "passes": passes,
            "replay_bytes": planner.cache.bytes() + _buffer_bytes(planner) if hub else 0}
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    out["ranks"] = every
    if rank == 0:
        torch.save(out, out_path)


def _buffer_bytes(planner) -> int:
    return sum(t.numel() * t.element_size() for e in planner.buffer.entries() for s in e.group.samples
               for t in (s.prompt_ids, s.response_ids, s.behavior_logprobs, s.token_versions))
