"""``python -m launch.trainer --config RUN_CONFIG [overrides]``: one trainer rank.

Started by ``launch.train`` with torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), or by ``srun`` with SLURM_PROCID/SLURM_NTASKS; only this entry point reads them.
It loads the run's resolved config with its secret (``launch.lifeline.start_child``) and runs
``megatron_darl.loop.trainer_loop.run_trainer``. When the loop gives up (``RunAborted``: its line
names the checkpoint kept), a checkpoint cannot be written or the one to resume from is damaged,
the rank logs the one line, writes it where the launcher reads it, and exits 1; a rank that lost
another trainer rank writes its line there and exits 3 at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Mapping, Sequence

from launch.lifeline import start_child
from launch.procs import TRAINER, exit_reason_path, write_exit_reason

if TYPE_CHECKING:
    from megatron_darl.loop.trainer_loop import DistEnv

# The loop (torch, Megatron) is imported in main(), not here: processes that Python's ``spawn``
# starts from this one re-import this module first, and dist_checkpointing's writer starts one
# (a multiprocessing Manager) at the first save: 0.1 s instead of ~3 s of imports.


def dist_env(env: Mapping[str, str]) -> "DistEnv":
    """This rank's coordinates from torchrun-style variables (or Slurm's, as a fallback)."""
    from megatron_darl.loop.trainer_loop import DistEnv

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="resolved run_config.yaml (from launch.train)")
    args, overrides = parser.parse_known_args(argv)
    from megatron_darl.loop.trainer_loop import RunAborted, run_trainer
    from megatron_darl.trainer.checkpoint_io import CheckpointDamaged
    from megatron_darl.trainer.disk import CheckpointFailed

    env = dist_env(os.environ)
    cfg = start_child(f"trainer{env.rank}", args.config, overrides)
    reason = exit_reason_path(cfg.loop.run_dir, TRAINER, env.rank)
    try:
        return run_trainer(cfg, env, say_why=lambda line: write_exit_reason(reason, line))
    except RunAborted as exc:  # its line says which checkpoint was kept
        logging.getLogger("launch.trainer").error("run aborted: %s", exc)
        write_exit_reason(reason, str(exc))
        return 1
    except (CheckpointFailed, CheckpointDamaged) as exc:  # a full disk at the end, a damaged resume: no traceback
        logging.getLogger("launch.trainer").error("%s", exc)
        write_exit_reason(reason, str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
