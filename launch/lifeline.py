"""Children of ``launch.train`` leave when their launcher disappears, and carry the run's secret.

Why: a SIGKILLed launcher (an OOM kill, ``kill -9``, a closed terminal) must not leave trainer
ranks and rollout workers running unsupervised, holding GPUs and ports. Each child started by
``launch.procs.Launcher`` gets ``DARL_LAUNCHER_PID`` and ``DARL_LAUNCHER_GRACE_S`` and calls
``exit_with_launcher`` first thing:

1. ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (Linux): the kernel sends SIGTERM when the launcher dies,
   so a trainer rank takes its usual graceful path (checkpoint at the end of the step, stop flag);
2. then it checks that the launcher is still its parent (it may have died before step 1);
3. a daemon thread polls the parent pid once a second (the fallback where step 1 is not
   available) and, once the launcher is gone, sends SIGTERM and after ``grace_s`` SIGKILLs the
   child's whole process group (reward sandboxes included).

Under Slurm there is no such variable (slurmstepd supervises the tasks) and nothing happens.

The run's secret never travels in the environment: a process's initial environment stays
readable in ``/proc/PID/environ`` for its whole life, whatever it removes from ``os.environ``
(a sandboxed program running as the worker's uid could read it there). ``launch.train`` hands each
child the secret on an inherited pipe (``DARL_RUN_SECRET_FD``), ``slurm/launch.sh`` in a file
only the job's user can read (``DARL_RUN_SECRET_FILE``); the child takes it once
(``take_run_secret``) and it goes on in the run config. Only ``launch/`` reads the environment.
``start_child`` is the common start of both kinds of child (``launch.trainer``, ``launch.rollout``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import secrets
import select
import signal
import stat
import threading
import time
from typing import Mapping, MutableMapping

LAUNCHER_PID = "DARL_LAUNCHER_PID"  # pid of the launch.train process that started this child
LAUNCHER_GRACE = "DARL_LAUNCHER_GRACE_S"  # seconds between SIGTERM and SIGKILL once it is gone
RUN_SECRET = "DARL_RUN_SECRET"  # the secret itself: hand-started processes only (see take_run_secret)
RUN_SECRET_FD = "DARL_RUN_SECRET_FD"  # an inherited pipe holding the secret (launch.train's children)
RUN_SECRET_FILE = "DARL_RUN_SECRET_FILE"  # a 0600 file holding the secret (slurm/launch.sh's steps)
SECRET_READ_TIMEOUT_S = 10.0  # the launcher writes the pipe before the child starts: EOF is immediate
_PR_SET_PDEATHSIG = 1
log = logging.getLogger("launch.lifeline")


def new_run_secret() -> str:
    """A fresh per-run secret (256 bits, hex)."""
    return secrets.token_hex(32)


def secret_pipe(secret: str) -> int:
    """The read end of a pipe that holds ``secret`` and then EOF, for one child to inherit."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, secret.encode())  # 64 hex characters: far below the pipe's buffer
    finally:
        os.close(write_fd)
    return read_fd


def _read_pipe(fd: int) -> str:
    data, deadline = b"", time.monotonic() + SECRET_READ_TIMEOUT_S
    try:
        while True:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError(f"{RUN_SECRET_FD}={fd}: no end of the run secret after "
                                   f"{SECRET_READ_TIMEOUT_S:.0f} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                return data.decode().strip()
            data += chunk
    finally:
        os.close(fd)


def _read_private_file(path: str) -> str:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{RUN_SECRET_FILE}={path}: the run secret file is open to other users "
                         f"(mode {stat.S_IMODE(mode):04o}); it must be 0600")
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def take_run_secret(env: MutableMapping[str, str]) -> str:
    """The run's secret, from where the launcher put it ("" when nowhere), taken out of ``env``
    (no grandchild inherits the way to it): ``DARL_RUN_SECRET_FD`` (a pipe, read and closed),
    ``DARL_RUN_SECRET_FILE`` (a file of the user's own, mode 0600), or ``DARL_RUN_SECRET`` (the
    secret itself, for processes started by hand: their /proc/PID/environ keeps it).

    Raises:
        ValueError: the secret file is readable by others, or a handed-over secret is empty.
        TimeoutError: the pipe never reached its end.
    """
    fd, path, plain = env.pop(RUN_SECRET_FD, ""), env.pop(RUN_SECRET_FILE, ""), env.pop(RUN_SECRET, "")
    if fd:
        secret, source = _read_pipe(int(fd)), f"{RUN_SECRET_FD}={fd}"
    elif path:
        secret, source = _read_private_file(path), f"{RUN_SECRET_FILE}={path}"
    else:
        if plain:
            log.warning("the run secret came in %s: it stays readable in this process's "
                        "/proc/PID/environ (launch.train and slurm/launch.sh pass it on a pipe or "
                        "in a 0600 file)", RUN_SECRET)
        return plain
    if not secret:
        raise ValueError(f"{source}: the run secret is empty")
    return secret


def with_run_secret(cfg, env: MutableMapping[str, str]):
    """``cfg`` (a ``RunConfig``) with ``transport.control.secret`` from ``take_run_secret``."""
    secret = take_run_secret(env)
    if not secret:
        if not cfg.transport.control.secret:
            log.warning("%s is not set: the control store accepts any process that reaches its port "
                        "(start runs with launch.train or slurm/launch.sh)", RUN_SECRET)
        return cfg
    control = dataclasses.replace(cfg.transport.control, secret=secret)
    return dataclasses.replace(cfg, transport=dataclasses.replace(cfg.transport, control=control))


def exit_with_launcher(env: Mapping[str, str], poll_s: float = 1.0) -> bool:
    """Tie this process's life to the launcher named in ``env``; returns whether one is named."""
    raw = env.get(LAUNCHER_PID, "")
    if not raw:
        return False
    launcher, grace_s = int(raw), float(env.get(LAUNCHER_GRACE, "30") or 30)
    _parent_death_signal(signal.SIGTERM)
    if os.getppid() != launcher:  # it died before the signal was armed
        _leave(launcher, grace_s)
    threading.Thread(target=_watch, args=(launcher, grace_s, poll_s), name="launcher-watch", daemon=True).start()
    return True


def _parent_death_signal(signum: int) -> bool:
    """Arm ``PR_SET_PDEATHSIG``; False where prctl is unavailable (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(launcher: int, grace_s: float, poll_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_s)
    _leave(launcher, grace_s)


def _leave(launcher: int, grace_s: float) -> None:
    """The launcher is gone: SIGTERM ourselves (graceful path), SIGKILL our group after ``grace_s``."""
    log.error("launcher (pid %d) is gone: stopping (SIGTERM now, SIGKILL in %.0f s)", launcher, grace_s)
    timer = threading.Timer(grace_s, lambda: os.killpg(os.getpgrp(), signal.SIGKILL))
    timer.daemon = True
    timer.start()
    os.kill(os.getpid(), signal.SIGTERM)


def start_child(name: str, config_file: str | None, overrides: list[str]):
    """First things of a child process: leave with the launcher, make what it forks leave with it
    (``run_lock.fence_forks``), log as ``name`` (libraries
    quiet unless ``loop.verbose``: ``launch.console``), take ``DARL_THREADS`` torch threads, and
    return the run's ``RunConfig`` with its secret."""
    from launch.config import load_run_config
    from launch.console import setup_logging
    from launch.run_lock import fence_forks

    exit_with_launcher(os.environ)
    cfg = load_run_config(overrides, config_file=config_file)  # imports no Megatron: its warnings come later
    fence_forks(cfg.loop.run_dir)  # what it forks (checkpoint writers) dies with it, without the run lock
    setup_logging(name, verbose=cfg.loop.verbose)
    threads = int(os.environ.get("DARL_THREADS", "0"))
    if threads:
        import torch

        torch.set_num_threads(threads)
    return with_run_secret(cfg, os.environ)
