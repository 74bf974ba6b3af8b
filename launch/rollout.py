"""``python -m launch.rollout --config RUN_CONFIG --worker-id I [overrides]``: one rollout worker.

Started by ``launch.train`` (or a Slurm job step) as its own process tree. It reads the run's
resolved config, builds the engine on the initial policy, this worker's shard of the prompts
(chat-templated token ids), the task's reward function, and runs ``RolloutWorker`` until the
trainer raises the stop flag (exit 0) or goes away (exit ``EXIT_TRAINER_LOST``).

``--defer-signals`` (``slurm/launch.sh`` passes it): ``scancel`` and ``sbatch --signal`` signal
every job step at once, but the trainer must finish its step, checkpoint and publish first, which
needs the workers alive. So SIGTERM/SIGUSR1 are only logged; the worker leaves on the trainer's
stop flag or when the trainer goes silent, and Slurm's SIGKILL after ``KillWait`` is the backstop.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from typing import Sequence

from launch.config import RunConfig, load_run_config
from launch.lifeline import exit_with_launcher, with_run_secret
from launch.procs import ROLLOUT, exit_reason_path, write_exit_reason


def build_prompt_source(cfg: RunConfig, tokenizer, worker_id: int):
    """This worker's shard of the dataset (tokenized prompts) and the dataset's size."""
    from megatron_darl.data import encode_prompt, load_dataset
    from megatron_darl.rollout.prompts import PromptRecord, PromptSource

    records = load_dataset(cfg.data).records
    prompts = [PromptRecord(r.prompt_id, tuple(encode_prompt(tokenizer, r.messages)), r) for r in records]
    source = PromptSource(prompts, shard=worker_id, num_shards=cfg.transport.control.num_workers,
                          seed=cfg.sampling.seed)
    return source, len(prompts)


def _resume_position(cfg: RunConfig, worker, worker_id: int, num_prompts: int) -> None:
    """Wait for the trainer's go; continue after the groups it already received from us."""
    from megatron_darl.loop.resume import prompt_position, worker_groups_made
    from megatron_darl.transport import connect_store

    control = cfg.transport.control
    store = connect_store(control, who=f"rollout {worker_id} (start)")
    made = worker_groups_made(store, worker_id, control.store_timeout_s)
    if made:
        shard_size = len(range(worker_id, num_prompts, control.num_workers))
        worker.load_state_dict({"prompts": prompt_position(made, shard_size), "groups_made": made})
        logging.getLogger("launch.rollout").info("resuming after %d groups", made)


def run_worker(cfg: RunConfig, worker_id: int) -> int:
    """Build the worker's parts and serve; returns the worker's exit code."""
    from transformers import AutoTokenizer

    from launch.engine_env import apply_engine_env
    from megatron_darl.rewards.registry import get_reward_fn
    from megatron_darl.rollout.engines import build_engine
    from megatron_darl.rollout.worker import RolloutWorker

    if not cfg.model.path:
        raise ValueError("model.path is empty: start workers through launch.train (it resolves the "
                         "warm-started policy) or pass model.path=<HF checkpoint dir>")
    engine_cfg = cfg.engine if cfg.engine.model_path else dataclasses.replace(cfg.engine, model_path=cfg.model.path)
    env = apply_engine_env(engine_cfg)  # before the engine (and its processes) start
    if env:
        logging.getLogger("launch.rollout").info("engine environment: %s", env)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    source, num_prompts = build_prompt_source(cfg, tokenizer, worker_id)
    engine = build_engine(engine_cfg)
    reward_fn = get_reward_fn(cfg.data.task)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    worker = RolloutWorker(dataclasses.replace(cfg.worker, worker_id=worker_id), cfg.transport,
                           engine, source, cfg.sampling, reward_fn, decode)
    _resume_position(cfg, worker, worker_id, num_prompts)
    try:
        code = worker.run()
        logging.getLogger("launch.rollout").info(
            "rollout %d: exit %d after %d groups sent; last weights version loaded %d",
            worker_id, code, worker.groups_sent, worker.weights_version)
        if code and worker.exit_reason:
            write_exit_reason(exit_reason_path(cfg.loop.run_dir, ROLLOUT, worker_id), worker.exit_reason)
        return code
    finally:
        engine.close()


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
    exit_with_launcher(os.environ)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rollout{args.worker_id} %(levelname)s %(message)s")
    if args.defer_signals:
        defer_stop_signals(args.worker_id)
    threads = int(os.environ.get("DARL_THREADS", "0"))
    if threads:
        import torch

        torch.set_num_threads(threads)
    cfg = with_run_secret(load_run_config(overrides, config_file=args.config), os.environ)
    return run_worker(cfg, args.worker_id)


if __name__ == "__main__":
    sys.exit(main())
