"""``python -m launch.trainer --config RUN_CONFIG [overrides]``: one trainer rank.

Started by ``launch.train`` with torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), or by ``srun`` with SLURM_PROCID/SLURM_NTASKS; only this entry point reads them.
It loads the run's resolved config with its secret (``launch.lifeline.start_child``), builds the
process groups and the policy trainer (``build_trainer``) and runs
``megatron_darl.loop.trainer_loop.run_trainer`` with them. When the loop gives up (``RunAborted``: its line
names the checkpoint kept), a checkpoint cannot be written or the one to resume from is damaged,
the rank logs the one line, writes it where the launcher reads it, and exits 1; a rank that lost
another trainer rank writes its line there and exits 3 at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from launch.lifeline import start_child
from launch.procs import TRAINER, exit_reason_path, write_exit_reason
from megatron_darl import timeline
from megatron_darl.exit_codes import ExitCode

if TYPE_CHECKING:
    from megatron_darl.loop.config import ModelConfig
    from megatron_darl.loop.run_config import RunConfig
    from megatron_darl.trainer.parallel import ParallelState
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

# The loop and the trainer (torch, Megatron) are imported in the functions that need them, not
# here: processes that Python's ``spawn`` starts from this one re-import this module first, and
# dist_checkpointing's writer starts one (a multiprocessing Manager) at the first save: 0.1 s
# instead of ~3 s of imports.


@dataclass
class DistEnv:
    """This process's place in the trainer world (from torchrun-style variables)."""

    rank: int  # global trainer rank
    world_size: int  # trainer ranks
    master_addr: str  # torch.distributed rendezvous host
    master_port: int  # torch.distributed rendezvous port


def dist_env(env: Mapping[str, str]) -> DistEnv:
    """This rank's coordinates from torchrun-style variables (or Slurm's, as a fallback)."""

    def pick(*names: str, default: str | None = None) -> str:
        for name in names:
            if env.get(name):
                return env[name]
        if default is None:
            raise ValueError(f"none of {names} is set: start trainer ranks with launch.train or srun")
        return default

    return DistEnv(rank=int(pick("RANK", "SLURM_PROCID")),
                   world_size=int(pick("WORLD_SIZE", "SLURM_NTASKS")),
                   master_addr=pick("MASTER_ADDR", default="127.0.0.1"),
                   master_port=int(pick("MASTER_PORT", default="29500")))


def _hf_config(model: ModelConfig) -> dict[str, Any]:
    from megatron_darl.models.qwen3.config import load_hf_config_dict

    if model.path:
        return load_hf_config_dict(model.path)
    if model.hf_config:
        return dict(model.hf_config)
    raise ValueError("model.path and model.hf_config are both empty (launch resolves the warm start)")


def build_trainer(cfg: RunConfig, env: DistEnv) -> tuple[PolicyTrainer, ParallelState]:
    """Process groups and the ``PolicyTrainer``, initialised from ``model.path`` when given,
    scoring the rollout sampler's density (``sampling.temperature``)."""
    from megatron_darl.loop.config import density_temperature
    from megatron_darl.trainer.parallel import init_parallel
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    ps = init_parallel(cfg.parallel, rank=env.rank, world_size=env.world_size,
                       init_method=f"tcp://{env.master_addr}:{env.master_port}")
    timeline.mark("parallel")
    tcfg = cfg.trainer
    if cfg.model.path and not tcfg.init_checkpoint:
        tcfg = dataclasses.replace(tcfg, init_checkpoint=cfg.model.path)
    s = cfg.sampling
    temperature = density_temperature(s.temperature, s.top_p, s.top_k)
    return PolicyTrainer(tcfg, ps, _hf_config(cfg.model), temperature=temperature), ps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="resolved run_config.yaml (from launch.train)")
    args, overrides = parser.parse_known_args(argv)
    from megatron_darl.checkpoint.disk import CheckpointFailed
    from megatron_darl.checkpoint.model_io import CheckpointDamaged
    from megatron_darl.loop.trainer_loop import RunAborted, run_trainer
    from megatron_darl.trainer.parallel import destroy_parallel
    from megatron_darl.trainer.weight_check import WeightsNotFinite

    env = dist_env(os.environ)
    cfg = start_child(f"trainer{env.rank}", args.config, overrides)
    timeline.start(cfg.loop.run_dir, f"trainer{env.rank}")
    timeline.mark("imports")  # torch, Megatron and the loop were imported above
    reason = exit_reason_path(cfg.loop.run_dir, TRAINER, env.rank)
    try:
        trainer, ps = build_trainer(cfg, env)
        timeline.mark("trainer_ready")
        code = run_trainer(cfg, trainer, ps, say_why=lambda line: write_exit_reason(reason, line))
        # every rank finished the same steps: tear the groups down (NCCL warns of a leak otherwise);
        # after a failure a peer may be gone, and the process exit frees them instead
        destroy_parallel()
        return code
    except RunAborted as exc:  # its line says which checkpoint was kept
        logging.getLogger("launch.trainer").error("run aborted: %s", exc)
        write_exit_reason(reason, str(exc))
        return ExitCode.FAILED
    except (CheckpointFailed, CheckpointDamaged, WeightsNotFinite) as exc:  # a full disk, a damaged resume: one line
        logging.getLogger("launch.trainer").error("%s", exc)
        write_exit_reason(reason, str(exc))
        return ExitCode.FAILED


if __name__ == "__main__":
    sys.exit(main())
