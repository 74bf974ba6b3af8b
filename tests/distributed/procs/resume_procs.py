"""Worker body of ``test_loop_resume_backfill.py``: the loop's step driven with fixed arrivals.

Each rank (DP2, one shard each) runs the real ``StepRunner`` (darl, K = 4, 2 PPO mini-batches,
``mis.backfill=snapshot``) on groups this driver generates: at step s, ``GROUPS`` groups whose
behavior log-probs are the trainer's own log-probs at version s plus engine-like noise, each
arriving ``group_id % 3`` steps later (staleness <= eta = 2). Modes:

* ``straight``: steps 0..N-1, checkpoint (with snapshots, as the loop writes it) after step
  ``RESUME_AT - 1``; writes every generated group so the other modes see the same arrivals;
* ``resume``: fresh processes load that checkpoint (snapshots included) and run the rest;
* ``nosnap``: the same without restoring the snapshots (the pre-issue-15 behaviour).

Recorded per step: the full HF-named weights (rank 0) and the backfill counts (DP sums), plus
every row the snapshot backfill produced, for the test's reference recomputation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

GROUPS, GROUP_SIZE, K, ETA = 4, 4, 4, 2
RESUME_AT, STEPS = 4, 7  # the K - 1 = 3 steps after the resume are compared


def _configs():
    from megatron_darl.step.config import AlgorithmConfig, ReplayConfig

    algo = AlgorithmConfig(variant="darl", groups_per_step=GROUPS, group_size=GROUP_SIZE,
                           max_staleness=ETA, ppo_minibatches=2)
    return algo, ReplayConfig(k=K)


def tiny_trainer(hf_dir: str, tp: int = 1, pp: int = 1):
    """The tiny Qwen3 trainer of these tests at TP x PP, initialised from ``hf_dir``."""
    from megatron_darl.models.qwen3.model import build_qwen3_model
    from megatron_darl.models.qwen3.weights import load_hf_checkpoint
    from megatron_darl.trainer.config import MicroBatchConfig, OptimizerConfig, TrainerConfig
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel
    from megatron_darl.trainer.policy_trainer import PolicyTrainer
    from trainer_procs import tiny_hf_config_dict

    ps = init_parallel(ParallelConfig(tp=tp, pp=pp, timeout_s=300))
    cfg = TrainerConfig(optimizer=OptimizerConfig(lr=1e-3, adam_eps=1e-6),
                        micro_batch=MicroBatchConfig(token_budget=64, max_seq_len=64, pad_multiple=8),
                        bf16=False)
    chunks = build_qwen3_model(tiny_hf_config_dict(), ps, calculate_per_token_loss=True)
    load_hf_checkpoint(chunks, hf_dir, ps)
    return PolicyTrainer(cfg, ps, tiny_hf_config_dict(), model_chunks=chunks), ps


def generate(trainer, step: int, logprobs=None) -> list:
    """GROUPS groups of version ``step``: random tokens, behavior rows = trainer rows + noise
    (``logprobs``: the pass to take them from; default the trainer's own)."""
    from megatron_darl.samples import Sample, SampleGroup
    from megatron_darl.step.sequences import response_lengths, sequence_batch

    g = torch.Generator().manual_seed(1000 + step)
    groups = []
    for j in range(GROUPS):
        gid = step * GROUPS + j
        samples = []
        for i in range(GROUP_SIZE):
            n = int(torch.randint(2, 9, (1,), generator=g))
            samples.append(Sample(
                sample_id=gid * 16 + i, prompt_ids=torch.randint(0, 256, (4,), generator=g),
                response_ids=torch.randint(0, 256, (n,), generator=g),
                behavior_logprobs=torch.zeros(n), token_versions=torch.full((n,), step),
                reward=float((i + j) % 2 if i < 2 else int(torch.randint(0, 2, (1,), generator=g)))))
        groups.append(SampleGroup(group_id=gid, prompt_id=gid, samples=samples, worker_id=0))
    flat = [s for grp in groups for s in grp.samples]
    logp = (logprobs or trainer.compute_logprobs)(sequence_batch(flat), trainer.version)
    for s, row in zip(flat, logp.split(response_lengths(flat).tolist())):
        s.behavior_logprobs = row + 0.05 * torch.randn(row.shape, generator=g)
    return groups


def _recording(trainer, rows: list):
    """The runner's log-prob source, recording every row of a snapshot (backfill) pass."""
    def logprobs(batch, version):
        logp = trainer.compute_logprobs(batch, version)
        if version != trainer.version:
            lens = batch.seq_lens.tolist()
            counts = [int(m.sum()) for m in batch.loss_mask.split(lens)]
            for ids, n, row in zip(batch.input_ids.split(lens), counts, logp.split(counts)):
                rows.append((ids[: len(ids) - n], ids[len(ids) - n:], version, row.clone()))
        return logp

    return logprobs


def resume_worker(rank: int, world_size: int, mode: str, hf_dir: str, ckpt: str, groups_path: str,
                  out_path: str) -> None:
    from megatron_darl.samples import shard_of
    from megatron_darl.step.planner import ShardPlanner
    from megatron_darl.step.runner import StepRunner
    from megatron_darl.checkpoint.training import load_checkpoint, save_checkpoint
    from trainer_procs import gather_hf_params

    algo, replay = _configs()
    trainer, ps = tiny_trainer(hf_dir)
    planner = ShardPlanner(algo, replay, shard=ps.dp_rank, num_shards=ps.dp_size)
    runner = StepRunner(algo, replay, planner, trainer, ps)
    rows: list = []
    runner.logprobs = _recording(trainer, rows)
    first, made = 0, {}
    if mode != "straight":
        resumed = load_checkpoint(trainer, ckpt, with_snapshots=mode == "resume")
        planner.load_state_dict(resumed.extra_states[ps.dp_rank]["planner"])
        made, first = torch.load(groups_path, weights_only=False), RESUME_AT
    trainer.snapshot(keep=replay.window.versions(trainer.version))  # as TrainerLoop.run does
    out = {"params": {}, "backfill": {}, "snapshots_at_start": trainer.snapshots.versions}
    for step in range(first, STEPS):
        if mode == "straight":
            made[step] = generate(trainer, step)
        arrivals = [grp for s, lst in made.items() for grp in lst if s + grp.group_id % 3 == step]
        mine = [grp for grp in arrivals if shard_of(grp.group_id, ps.dp_size, 1) == ps.dp_rank]  # one worker
        plan, _ = runner.run(mine, step)
        planner.evict(trainer.version, plan.stats)
        counts = ps.dp_sum(torch.tensor([plan.stats.backfill_snapshot, plan.stats.backfill_nearest]))
        out["backfill"][step] = counts.tolist()
        out["params"][step] = gather_hf_params(trainer, ps)
        if mode == "straight" and step + 1 == RESUME_AT:
            out["save_phases"] = {}
            save_checkpoint(trainer, ckpt, extra_state={"planner": planner.state_dict()},
                            with_snapshots=True, phases=out["save_phases"])
    every = [None] * world_size
    dist.all_gather_object(every, rows)
    out["rows"] = [r for part in every for r in part]
    if rank == 0:
        if mode == "straight":
            torch.save(made, groups_path)
        torch.save(out, out_path)
