"""One run at a time on a run directory: ``<run_dir>/run.lock``, held for the run's life.

Why: two runs on one run dir would share it unknowingly: one would train with the other's
``run_config.yaml``, die on EADDRINUSE, or wait 300 s with 0 steps. The second launcher is
refused in one line naming the holder (host, pid, start time, Slurm job id), exit 2, before it
writes anything in the dir (the lock file is the one file it opens).

How: ``flock(2)`` on the lock file plus the holder's record in it (JSON: host, pid, the pid's
start time, Slurm job id, command). The kernel drops a flock when its last holder exits, so a
record left behind by a dead holder is stale: the next run takes the lock over and says whose
it was. The launcher's children inherit the locked descriptor (``launch.procs``), so a run
whose launcher was SIGKILLed keeps its dir until the children it left behind are gone. flock
works across the nodes of NFSv4 and Lustre (``-o flock``) mounts; on a filesystem without locks
(``ENOLCK``/``EOPNOTSUPP``) the record alone decides: a holder on this host whose process is
gone is stale, one on another host is refused (delete the lock file once sure it is over).

Processes a child forks (megatron-core's checkpoint writers: ``dist_checkpointing`` forks one
writer per file bucket on every save, an async save one more) are another matter: a trainer
killed mid-save can leave them orphaned and hung, holding ``run.lock`` through the descriptor
they inherited (3 of 8 kills measured; once for 7+ minutes), so a resume would be refused with no
one to wait for.
``fence_forks`` (called by every child at start, ``launch.lifeline.start_child``) makes each
process forked from then on close its copies of the lock and, when the parent's main thread
forked it (the signal follows the forking thread), die with its parent (``PR_SET_PDEATHSIG``). A launch that finds the lock held names the processes holding it, with
their command lines, read from ``/proc`` (``lock_holders``).

On Slurm, ``slurm/launch.sh`` opens the lock file itself and passes the descriptor in
``DARL_RUN_LOCK_FD``; ``launch.slurm prepare`` locks it and writes the record with the job id,
and the batch script holds it until the job ends (a requeued job finds its own earlier record:
stale, taken over).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

from megatron_darl.exit_codes import ExitCode

LOCK_NAME = "run.lock"
LOCK_FD_ENV = "DARL_RUN_LOCK_FD"  # a descriptor of the lock file opened by slurm/launch.sh
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

log = logging.getLogger("launch.run_lock")


class RunDirBusy(ValueError):
    """Another run holds the run dir; the message names it."""


@dataclass
class Holder:
    """The record a lock holder writes into the lock file."""

    host: str  # socket.gethostname() of the launcher
    pid: int  # its process id
    started: str  # when it took the lock, local time (ISO 8601)
    pid_started: float = 0.0  # the process's start time (tells a reused pid apart)
    job_id: str = ""  # SLURM_JOB_ID, when it runs in a Slurm job
    command: str = ""  # its command line, for the message

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"host {self.host} pid {self.pid}{job}, started {self.started}"

    def alive(self) -> bool | None:
        """Whether the holder process still runs; None when it is on another host."""
        if self.host != socket.gethostname():
            return None
        import psutil

        try:
            created = psutil.Process(self.pid).create_time()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        except psutil.AccessDenied:
            return True
        return not self.pid_started or abs(created - self.pid_started) < 1.0


def me(env: Mapping[str, str], pid: int) -> Holder:
    """This run's record; ``pid`` is the process that holds the lock for the run."""
    import psutil

    return Holder(host=socket.gethostname(), pid=pid, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  pid_started=psutil.Process(pid).create_time(), job_id=env.get("SLURM_JOB_ID", ""),
                  command=" ".join(sys.argv)[:300])


def _read(fd: int) -> Holder | None:
    try:
        data = json.loads(os.pread(fd, 65536, 0).decode("utf-8") or "null")
        return Holder(**data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None


class RunLock:
    """The held lock of one run dir; ``fd`` is inherited by the run's children."""

    def __init__(self, path: Path, fd: int, holder: Holder, owned_fd: bool) -> None:
        self.path, self.fd, self.holder, self._owned_fd = path, fd, holder, owned_fd

    @classmethod
    def acquire(cls, run_dir: str | Path, env: Mapping[str, str] | None = None,
                say: Callable[[str], None] = log.warning, name: str = "loop.run_dir") -> "RunLock":
        """Lock ``run_dir`` (created if absent) or raise ``RunDirBusy`` naming the holder
        (``name``: how messages call the run dir: ``loop.run_dir``, Slurm's ``OUTPUT_DIR``)."""
        env = os.environ if env is None else env
        path = Path(run_dir) / LOCK_NAME
        owned = LOCK_FD_ENV not in env
        if owned:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        else:
            fd = int(env[LOCK_FD_ENV])
        pid = os.getpid() if owned else os.getppid()  # Slurm: the batch script holds the lock
        try:
            flocked = cls._flock(fd, path, name, run_dir)
            previous = _read(fd)
            if previous is not None and (previous.host, previous.pid) != (socket.gethostname(), pid):
                cls._check_stale(previous, flocked, path, name, run_dir, say)
        except BaseException:
            if owned:
                os.close(fd)
            raise
        holder = me(env, pid)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(asdict(holder)) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(path, fd, holder, owned)

    @staticmethod
    def _flock(fd: int, path: Path, name: str, run_dir) -> bool:
        """True when locked; False when the filesystem has no locks; ``RunDirBusy`` when held."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = _read(fd)
            if holder is None:
                who = "a run that is starting (no holder record yet)"
            else:
                who = holder.describe() + (f" ({holder.command})" if holder.command else "")
                if holder.alive() is False:
                    who += f"; pid {holder.pid} has exited, processes it started still hold the lock"
            held = lock_holders(path, exclude=os.getpid())
            if held:
                who += "; held by " + ", ".join(f"pid {pid} ({cmd})" for pid, cmd in held[:4])
            raise RunDirBusy(f"{name}={run_dir} is in use by another run: {who}; lock {path}. "
                             f"Wait for it to end or stop it, or use another {name}") from None
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise
            log.warning("%s: the filesystem has no file locks (%s): the holder record alone guards "
                        "the run dir", path, os.strerror(exc.errno))
            return False

    @staticmethod
    def _check_stale(previous: Holder, flocked: bool, path: Path, name: str, run_dir, say) -> None:
        """A record without a live holder is taken over (and said); a live one is refused."""
        alive = previous.alive()
        if alive or (alive is None and not flocked):
            where = "" if alive else " on another host of a filesystem without locks"
            raise RunDirBusy(f"{name}={run_dir} is in use by another run{where}: {previous.describe()}; "
                             f"lock {path}. Wait for it to end or stop it (delete the lock file only "
                             f"once sure it is over), or use another {name}")
        why = "its process is gone" if alive is False else "its lock was released"
        say(f"{name}={run_dir}: took over the stale lock of {previous.describe()} ({why})")

    def release(self) -> None:
        """Clear the record and unlock (the run is over); a no-op once released."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        if self._owned_fd:
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holders(path: Path, exclude: int = -1) -> list[tuple[int, str]]:
    """``(pid, command line)`` of this host's processes with ``path`` open (from ``/proc``; those
    this user may read), but ``exclude``; [] where there is no ``/proc``."""
    target, found = os.path.realpath(path), []
    try:
        pids = sorted(int(d) for d in os.listdir("/proc") if d.isdigit())
    except OSError:
        return []
    for pid in pids:
        if pid == exclude:
            continue
        try:
            if not any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append((pid, cmd[:160] or "?"))
    return found


def fence_forks(run_dir: str | Path) -> list[int]:
    """Every process this one forks from now on closes its copies of ``run_dir``'s lock and gets
    SIGKILL when its parent dies (``PR_SET_PDEATHSIG``; a parent already gone: it exits at once).
    Returns the lock's descriptors found here (inherited from the launcher)."""
    target = os.path.realpath(Path(run_dir) / LOCK_NAME)
    fds = []
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            if os.path.realpath(f"/proc/self/fd/{name}") == target:
                fds.append(int(name))
        except OSError:
            continue
    os.register_at_fork(before=_note_forking_pid, after_in_child=lambda: _fenced_child(fds))
    return fds


_forking_pid = 0  # set just before a fork: in the child, its parent's pid
_forking_main = True  # ... and whether the parent's main thread forked it


def _note_forking_pid() -> None:
    import threading

    global _forking_pid, _forking_main
    _forking_pid, _forking_main = os.getpid(), threading.current_thread() is threading.main_thread()


def _fenced_child(lock_fds: list[int]) -> None:
    """In a freshly forked child: drop the lock, die with the parent (see ``fence_forks``)."""
    import ctypes
    import signal

    parent = _forking_pid
    for fd in lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if not _forking_main:  # the signal follows the forking *thread*: one that ends would kill the child
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the lock descriptors are closed at least
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(ExitCode.FAILED)
