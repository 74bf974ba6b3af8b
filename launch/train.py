"""``python -m launch.train [hydra overrides]``: the whole run on one machine, as separate processes.

Composes ``configs/config.yaml`` once, checks it and the dataset (``launch.preflight``,
``launch.validate``), locks the run dir (``launch.run_lock``: one run at a time), settles what an
earlier run left there (``launch.run_dir``: the resume point, config changes), fits (or reuses)
the embedded default's warm-started policy when no model is given, writes the resolved config to
``<run_dir>/run_config.yaml`` once every check passed (a refusal exits 2 in one line), and
starts the same processes Slurm job steps would: ``cluster.trainer_ranks`` x ``launch.trainer``
(torchrun-style environment) and ``cluster.rollout_workers`` x ``launch.rollout``, which meet
only over the transport, with free ports and a fresh per-run secret (``launch.lifeline``) that
only they know. Devices come from the cluster preset (``cluster=cpu|gpu1|gpu2``, ``gpu4`` and GPU
counts ``cluster.trainer_gpus=T cluster.rollout_gpus=R``, or ``local``: whatever this machine has). ``--print-config`` shows the composed config and exits;
``--verbose`` shows the libraries' logs too (``launch.cli``: the flags and config errors;
``launch.console``: what is printed).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Sequence

from launch.cli import explain, parse_command_line
from launch.config import ClusterConfig, RunConfig, load_run_config
from launch.console import setup_logging
from launch.lifeline import new_run_secret
from launch.outcome import outcome
from launch.preflight import max_positions, preflight
from launch.procs import ROLLOUT, TRAINER, Launcher, ProcSpec, exit_reason_path
from launch.run_dir import check_changes, commit_config, inspect_run_dir
from launch.run_lock import RunLock
from launch.validate import check_inputs
from megatron_darl import timeline
from megatron_darl.checkpoint.resume_points import latest_checkpoint
from megatron_darl.exit_codes import ExitCode
from megatron_darl.loop.stop_request import clear_request, write_request
from megatron_darl.ports import free_port

log = logging.getLogger("launch.train")


def resolve_devices(cluster: ClusterConfig, num_gpus: int) -> tuple[list[int], list[int]]:
    """(trainer, rollout) CUDA ordinals; ``null`` lists resolved from the GPUs present."""
    trainer = cluster.trainer_devices
    if trainer is None:
        trainer = list(range(min(cluster.trainer_ranks, num_gpus)))
    rollout = cluster.rollout_devices
    if rollout is None:
        spare = [g for g in range(num_gpus) if g not in trainer]
        rollout = spare[: cluster.rollout_workers] or trainer[:1]
    for name, devs in (("trainer_devices", trainer), ("rollout_devices", rollout)):
        bad = [d for d in devs if d >= num_gpus]
        if bad:
            seen = f"{num_gpus} GPU(s) visible" if num_gpus else "no GPU visible to torch"
            raise ValueError(f"cluster.{name}={devs}: GPU(s) {bad} not present ({seen}, CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); pick a cluster preset "
                             "this machine has: cluster=local (whatever is here) or cluster=cpu")
    return list(trainer), list(rollout)


def prepare(cfg: RunConfig, log_fn=print) -> RunConfig:
    """Fill what the children must all agree on: the policy path and free ports (0 = pick)."""
    model = cfg.model
    if model.needs_warm_start:
        from launch.warmstart import ensure_warm_policy

        model = dataclasses.replace(model, path=str(ensure_warm_policy(cfg.warmstart, log=log_fn)))
    engine = cfg.engine
    if not engine.model_path and model.path:
        engine = dataclasses.replace(engine, model_path=model.path)
    worker = cfg.worker
    if cfg.loop.resume and latest_checkpoint(cfg.loop.run_dir) is not None:  # the loop's own answer
        worker = dataclasses.replace(worker, initial_version=-1)  # wait for the resumed weights
    cluster, control = cfg.cluster, cfg.transport.control
    if cluster.master_port == 0:
        cluster = dataclasses.replace(cluster, master_port=free_port())
    if control.port == 0:
        control = dataclasses.replace(control, port=free_port())
    transport = dataclasses.replace(cfg.transport, control=control)
    return dataclasses.replace(cfg, model=model, engine=engine, worker=worker, cluster=cluster,
                               transport=transport)


def _visible(devices: list[int]) -> str:
    return ",".join(str(d) for d in devices)


def process_specs(cfg: RunConfig, config_path: Path, num_gpus: int,
                  base_env: dict[str, str] | None = None, secret: str = "") -> list[ProcSpec]:
    """The trainer ranks and rollout workers of this run, with their environments and logs;
    ``secret`` (the run's control-store secret) reaches every child on a pipe (``ProcSpec.secret``)."""
    env0 = dict(os.environ if base_env is None else base_env)
    c = cfg.cluster
    trainer_devs, rollout_devs = resolve_devices(c, num_gpus)
    nprocs = c.trainer_ranks + c.rollout_workers
    threads = c.threads_per_process or max(1, (os.cpu_count() or 1) // nprocs)
    common = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "DARL_THREADS": str(threads)}
    logs = Path(cfg.loop.run_dir) / "logs"
    specs = []
    for rank in range(c.trainer_ranks):
        env = {**env0, **common, "RANK": str(rank), "WORLD_SIZE": str(c.trainer_ranks),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(c.trainer_ranks),
               "MASTER_ADDR": c.master_addr, "MASTER_PORT": str(c.master_port),
               "CUDA_VISIBLE_DEVICES": _visible(trainer_devs)}
        argv = [sys.executable, "-m", "launch.trainer", "--config", str(config_path)]
        specs.append(ProcSpec(TRAINER, rank, argv, env, None if rank == 0 else logs / f"trainer{rank}.log",
                              exit_reason_path(cfg.loop.run_dir, TRAINER, rank), secret=secret))
    for wid in range(c.rollout_workers):
        dev = [rollout_devs[wid % len(rollout_devs)]] if rollout_devs else []
        env = {**env0, **common, "CUDA_VISIBLE_DEVICES": _visible(dev)}
        argv = [sys.executable, "-m", "launch.rollout", "--config", str(config_path),
                "--worker-id", str(wid)]
        specs.append(ProcSpec(ROLLOUT, wid, argv, env, logs / f"rollout{wid}.log",
                              exit_reason_path(cfg.loop.run_dir, ROLLOUT, wid), secret=secret))
    return specs


class RestartNotice:
    """Tells the trainer (``Keys.restarts`` in the run's store) that the launcher starts a rollout
    worker again: until the new process beats, the trainer does not count the worker as gone (a
    run whose only worker restarts must not end meanwhile). Best effort, with short deadlines: a
    store that does not answer costs the launcher seconds, never the restart."""

    def __init__(self, cfg: RunConfig, secret: str) -> None:
        self._control = dataclasses.replace(cfg.transport.control, secret=secret, store_timeout_s=5.0,
                                            call_timeout_s=5.0)
        self._store = None
        self._warm = cfg.cluster.rollout_restarts > 0

    def warm(self) -> None:
        """Import the store's module (torch: seconds on a busy host) in a thread once the children
        are started: paid then, not while a worker is down and the trainer counts the time, nor
        before the children start (``test_launcher_cost``). At full priority: a restart's notice
        waits for this import to finish (the module lock), so a starved one would only be later."""
        if self._warm:
            threading.Thread(target=importlib.import_module, args=("megatron_darl.transport.store",),
                             name="restart-notice-import", daemon=True).start()

    def __call__(self, spec: ProcSpec, restart: int) -> None:
        if spec.role != ROLLOUT:
            return
        # imported here, not before the children start (``warm`` has, once they did)
        from megatron_darl.transport import WORKER, TransportTimeout, connect_store
        from megatron_darl.transport.store import Keys

        try:
            if self._store is None:
                self._store = connect_store(self._control, who="launch.train")
            self._store.set(Keys.restarts(WORKER, spec.rank), str(restart))
        except (TransportTimeout, RuntimeError, OSError, ValueError) as exc:
            log.warning("could not tell the trainer that %s restarts: %s", spec.name, exc)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def _num_gpus() -> int:
    """The GPUs this process sees; on a host without NVIDIA's driver, 0 without importing torch."""
    if not Path("/dev/nvidiactl").exists():
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 (a broken CUDA install means: no GPU)
        return 0


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def config_groups(config_dir: Path = CONFIG_DIR) -> dict[str, list[str]]:
    """The groups ``configs/config.yaml``'s defaults list selects (each one overridable as
    ``GROUP=PRESET``) and their presets; folders it does not name (``configs/eval/``: the table of
    ``tools/eval.py``) are not run groups."""
    import yaml

    defaults = yaml.safe_load((config_dir / "config.yaml").read_text())["defaults"]
    names = [next(iter(d)).split("@")[0] for d in defaults if isinstance(d, dict)]
    return {n: sorted(f.stem for f in (config_dir / n).glob("*.yaml"))
            for n in sorted(names) if (config_dir / n).is_dir()}


def usage() -> str:
    """Usage text: the config groups of ``configs/config.yaml`` and their presets."""
    lines = ["usage: python -m launch.train [--print-config] [--verbose] [GROUP=PRESET | KEY=VALUE ...]", "",
             __doc__.strip().splitlines()[0], "", "config groups (GROUP=PRESET):"]
    for group, presets in config_groups().items():
        lines.append(f"  {group:<10} {' | '.join(presets)}")
    lines += ["", "examples:", "  python -m launch.train algorithm=sync",
              "  python -m launch.train rollout=vllm model=qwen3_1.7b model.path=/path/to/Qwen3-1.7B",
              "  python -m launch.train experiment=smoke          # a fresh runs/smoke_<variant>_<time>",
              "  python -m launch.train --print-config algorithm=darl replay.k=8",
              "  python -m launch.train --verbose                 # Megatron's own logs and warnings too"]
    return "\n".join(lines)


def _load(args: list[str]) -> RunConfig:
    """The run config, or ``SystemExit(ExitCode.USAGE)`` with what is wrong (``launch.cli.explain``)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return load_run_config(args)
    except (HydraException, OmegaConfBaseException) as err:
        print(f"launch.train: {explain(err)}\n(see python -m launch.train --help)", file=sys.stderr)
        raise SystemExit(ExitCode.USAGE) from None
    except ValueError as err:  # ours: already one line naming the field
        print(f"launch.train: {explain(err)}", file=sys.stderr)
        raise SystemExit(ExitCode.USAGE) from None


def main(argv: Sequence[str] | None = None) -> int:
    timeline.note("main_start")  # the launcher's imports are done (the launch timeline's phases)
    try:
        cli = parse_command_line(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        print(f"launch.train: {err}", file=sys.stderr)
        return ExitCode.USAGE
    if cli.help:
        print(usage())
        return ExitCode.OK
    # before the config: composing it can already say why (cluster.split=auto: launch.split)
    setup_logging("launch.train", verbose="loop.verbose=true" in cli.overrides)
    cfg = _load(cli.overrides)
    timeline.note("config_loaded")
    if cli.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return ExitCode.OK
    run_dir = Path(cfg.loop.run_dir)
    try:
        preflight(cfg)  # values, task, files, model shape: nothing in the run dir yet
        resolve_devices(cfg.cluster, _num_gpus())  # the GPUs the cluster preset names are here
        lock = RunLock.acquire(run_dir)  # refused naming the holder when another run has the dir
    except ValueError as err:
        print(f"launch.train: {err}", file=sys.stderr)
        return ExitCode.USAGE
    with lock:
        try:
            cfg, config_path = settle(cfg)
            timeline.note("inputs_checked")
        except ValueError as err:
            print(f"launch.train: {err}", file=sys.stderr)
            return ExitCode.USAGE
        return _run(cfg, config_path, run_dir, lock)


def settle(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """The run dir's checks, the resolved config and its ``run_config.yaml``, written last: a
    launch refused here (``ValueError``, one line) leaves the run dir as it found it."""
    state = inspect_run_dir(cfg)
    cfg = prepare(cfg)
    check_changes(cfg, state)
    check_inputs(cfg, max_positions(cfg))
    return cfg, commit_config(cfg, state)


def _run(cfg: RunConfig, config_path: Path, run_dir: Path, lock: RunLock) -> int:
    timeline.begin(run_dir)  # t0 of this launch's timeline: this process's start
    secret = cfg.transport.control.secret or new_run_secret()  # per run, never written to disk
    specs = process_specs(cfg, config_path, _num_gpus(), secret=secret)
    log.info("%s, %d steps, model %s, data %s: %d trainer rank(s), %d rollout worker(s); run dir %s "
             "(worker logs in logs/)", cfg.algorithm.variant, cfg.loop.steps, cfg.model.name, cfg.data.name,
             cfg.cluster.trainer_ranks, cfg.cluster.rollout_workers, run_dir)
    notice = RestartNotice(cfg, secret)
    clear_request(run_dir)  # a stop request is for the launch in progress (stop_request.py)
    try:
        result = Launcher(specs, grace_s=cfg.cluster.grace_s, rollout_failure=cfg.cluster.rollout_failure,
                          pass_fds=(lock.fd,),  # the children hold the run dir's lock too
                          rollout_restarts=cfg.cluster.rollout_restarts, on_restart=notice,
                          # a stop signal forwarded is written down too: the trainer may not see it
                          on_stop=lambda signum: write_request(run_dir, signum),
                          on_started=notice.warm).run()
    finally:
        notice.close()
    for failure in result.failures:
        log.error("%s", failure)
    if result.code == 0:
        print(outcome(run_dir, cfg.loop.steps), flush=True)
    else:
        first = result.failures[0].splitlines()[0] if result.failures else f"signal {result.signal}"
        log.error("run failed (exit %d): %s", result.code, first)
    return result.code


if __name__ == "__main__":
    sys.exit(main())
