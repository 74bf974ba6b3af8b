"""``python -m launch.rollout --config RUN_CONFIG --worker-id I [overrides]``: one rollout worker.

Started by ``launch.train`` (or a Slurm job step) as its own process tree. It loads the run's
resolved config with its secret (``launch.lifeline.start_child``), sets the engine's environment
(``launch.engine_env``) and runs ``megatron_darl.loop.rollout_loop.run_rollout`` until the
trainer raises the stop flag (exit 0). When the worker stops on its own (``RolloutAborted``: the
trainer went away, the engine could not load the weights) it writes the one line where the
launcher reads it and exits with the worker's code.

``--defer-signals`` (``slurm/launch.sh`` passes it): ``scancel`` and ``sbatch --signal`` signal
every job step at once, but the trainer must finish its step, checkpoint and publish first, which
needs the workers alive. So SIGTERM/SIGUSR1 are only logged; the worker leaves on the trainer's
stop flag or when the trainer goes silent, and Slurm's SIGKILL after ``KillWait`` is the backstop.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Sequence

from launch.engine_env import apply_engine_env
from launch.lifeline import start_child
from launch.procs import ROLLOUT, exit_reason_path, write_exit_reason
from megatron_darl import timeline
from megatron_darl.loop.rollout_loop import RolloutAborted, engine_config, run_rollout


def defer_stop_signals(worker_id: int) -> None:
    """Log SIGTERM/SIGUSR1 instead of dying: the trainer's stop flag ends the worker (see above)."""
    def note(signum: int, frame) -> None:  # noqa: ARG001 (signal API)
        logging.getLogger("launch.rollout").warning(
            "rollout %d: signal %d: serving until the trainer checkpoints and raises the stop flag",
            worker_id, signum)

    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, note)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="resolved run_config.yaml (from launch.train)")
    parser.add_argument("--worker-id", type=int, required=True, help="rollout worker id")
    parser.add_argument("--defer-signals", action="store_true",
                        help="SIGTERM/SIGUSR1 do not stop the worker; the trainer's stop flag does (Slurm)")
    args, overrides = parser.parse_known_args(argv)
    if args.defer_signals:
        defer_stop_signals(args.worker_id)
    cfg = start_child(f"rollout{args.worker_id}", args.config, overrides)
    timeline.start(cfg.loop.run_dir, f"rollout{args.worker_id}")
    env = apply_engine_env(engine_config(cfg))  # before the engine (and its processes) start
    if env:
        logging.getLogger("launch.rollout").info("engine environment: %s", env)
    try:
        return run_rollout(cfg, args.worker_id)
    except RolloutAborted as exc:
        if str(exc):
            write_exit_reason(exit_reason_path(cfg.loop.run_dir, ROLLOUT, args.worker_id), str(exc))
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
