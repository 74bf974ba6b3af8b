"""Benchmark ``replay_memory``: peak host memory per trainer rank, replay state on the hub or everywhere.

One DP replica at TP2 x PP2 (4 gloo ranks on CPU, a tiny Qwen3) runs ``--steps`` darl steps of
the loop's real planner and trainer on synthetic arrivals: ``--groups`` selectable groups per
step plus ``--idle-groups`` groups whose rewards are all equal (buffered until evicted, never
selected: the bulk of a real buffer's bytes at low cost), ``--group-size`` x ``--tokens`` each.

- ``--state hub`` (the loop's layout): the planner, buffer and cache live on the hub rank (TP 0, PP 0);
  its peers get each step's batches by broadcast (``step/replica.py``).
- ``--state replicated`` (the alternative it is measured against): the groups are pickled to every rank of the
  replica (``broadcast_object_list``) and each rank runs its own planner on them.

Reported per rank: peak resident memory (``VmHWM``), the replay state it holds (buffer + cache
bytes), and the mean step seconds.

    python benchmarks/replay_memory.py --state hub
    python benchmarks/replay_memory.py --state replicated
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402

TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=256, hidden_size=64,
            intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rope_parameters={"rope_theta": 1e6}, rms_norm_eps=1e-6,
            tie_word_embeddings=True, max_position_embeddings=1024)


def _peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_groups(a, step: int, first_id: int) -> list:
    """This step's arrivals (version ``step``): selectable groups, then idle (all-equal) ones."""
    from megatron_darl.samples import Sample, SampleGroup

    g = torch.Generator().manual_seed(step)
    out = []
    for j in range(a.groups + a.idle_groups):
        gid, idle = first_id + j, j >= a.groups
        tokens = a.tokens if idle else a.train_tokens
        samples = [Sample(sample_id=gid * 64 + i, prompt_ids=torch.randint(0, 256, (8,), generator=g),
                          response_ids=torch.randint(0, 256, (tokens,), generator=g),
                          behavior_logprobs=-torch.rand(tokens, generator=g) * 5,
                          token_versions=torch.full((tokens,), step), reward=0.0 if idle else float(i % 2))
                   for i in range(a.group_size)]
        out.append(SampleGroup(group_id=gid, prompt_id=gid, samples=samples, worker_id=0))
    return out


def _replay_bytes(planner) -> int:
    if planner is None:
        return 0
    held = sum(t.numel() * t.element_size() for e in planner.buffer.entries() for s in e.group.samples
               for t in (s.prompt_ids, s.response_ids, s.behavior_logprobs, s.token_versions))
    return held + planner.cache.bytes()


def worker(rank: int, world_size: int, a, out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_darl.step.config import AlgorithmConfig, ReplayConfig
    from megatron_darl.step.planner import ShardPlanner
    from megatron_darl.step.runner import StepRunner, loss_fn_for
    from megatron_darl.trainer.config import MicroBatchConfig, TrainerConfig
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    ps = init_parallel(ParallelConfig(tp=2, pp=2, timeout_s=600))
    trainer = PolicyTrainer(TrainerConfig(micro_batch=MicroBatchConfig(
        token_budget=4096, max_seq_len=max(a.tokens, a.train_tokens) + 16, pad_multiple=8), bf16=False), ps, TINY)
    algo = AlgorithmConfig(variant="darl", groups_per_step=a.groups, group_size=a.group_size, max_staleness=2)
    replay = ReplayConfig(k=4)
    hub = ps.tp_rank == 0 and ps.pp_rank == 0
    planner = ShardPlanner(algo, replay) if (hub or a.state == "replicated") else None
    runner = StepRunner(algo, replay, planner if hub else None, trainer, ps) if a.state == "hub" else None
    trainer.snapshot()
    before, seconds = _peak_mb(), []
    for step in range(a.steps):
        start = time.perf_counter()
        groups = make_groups(a, step, step * 10_000) if hub else []
        if runner is not None:
            plan, _ = runner.run(groups, step)
        else:  # every rank gets the groups and plans on its own, as before
            box = [groups]
            dist.broadcast_object_list(box, src=dist.get_global_rank(ps.model_parallel_group, 0),
                                       group=ps.model_parallel_group)
            plan = planner.step(box[0], step, trainer.version, trainer.compute_logprobs,
                                trainer.snapshots.versions)
            trainer.train_steps(plan.minibatches, loss_fn_for(0.2, 0.2))
            trainer.snapshot(keep=replay.window.versions(trainer.version))
        if planner is not None:
            planner.evict(trainer.version, plan.stats)
        seconds.append(time.perf_counter() - start)
    record = {"rank": rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "peak_mb": _peak_mb(), "start_peak_mb": before,
              "replay_mb": _replay_bytes(planner) / 2**20, "step_seconds": sum(seconds[1:]) / max(1, len(seconds) - 1)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", choices=("hub", "replicated"), default="hub")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--groups", type=int, default=4, help="selectable groups per step (B)")
    p.add_argument("--idle-groups", type=int, default=300, help="all-equal-reward groups per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="response tokens of an idle group's samples")
    p.add_argument("--train-tokens", type=int, default=32, help="response tokens of a selectable sample")
    a = p.parse_args()
    from megatron_darl.trainer.parallel import run_local_gloo

    with tempfile.TemporaryDirectory() as out:
        run_local_gloo(worker, 4, args=(a, out), timeout_s=3000)
        ranks = sorted((json.loads(f.read_text()) for f in Path(out).glob("rank*.json")), key=lambda r: r["rank"])
    metrics = {"peak_host_mb": [r["peak_mb"] for r in ranks], "replay_state_mb": [r["replay_mb"] for r in ranks],
               "start_host_mb": [r["start_peak_mb"] for r in ranks],
               "step_seconds": max(r["step_seconds"] for r in ranks)}
    config = {"state": a.state, "layout": "tp2pp2", "steps": a.steps, "groups": a.groups,
              "idle_groups": a.idle_groups, "group_size": a.group_size, "tokens": a.tokens,
              "train_tokens": a.train_tokens}
    print_table([{"rank": r["rank"], "tp": r["tp"], "pp": r["pp"], "peak_host_mb": r["peak_mb"],
                  "replay_state_mb": r["replay_mb"], "step_seconds": r["step_seconds"]} for r in ranks])
    print(write_result("replay_memory", config, metrics))


if __name__ == "__main__":
    main()
