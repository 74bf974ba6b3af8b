"""One run at a time on a run directory: ``<run_dir>/run.lock``, held for the run's life.

Why: two runs started on one run dir used to share it unknowingly: one trained with the
other's ``run_config.yaml``, one died on EADDRINUSE, or one waited 300 s with 0 steps. The
second launcher is now refused in one line naming the holder (host, pid, start time, Slurm job
id), exit 2, before it writes anything in the dir (the lock file is the one file it opens).

How: ``flock(2)`` on the lock file plus the holder's record in it (JSON: host, pid, the pid's
start time, Slurm job id, command). The kernel drops a flock when its last holder exits, so a
record left behind by a dead holder is stale: the next run takes the lock over and says whose
it was. The launcher's children inherit the locked descriptor (``launch.procs``), so a run
whose launcher was SIGKILLed keeps its dir until the children it left behind are gone. flock
works across the nodes of NFSv4 and Lustre (``-o flock``) mounts; on a filesystem without locks
(``ENOLCK``/``EOPNOTSUPP``) the record alone decides: a holder on this host whose process is
gone is stale, one on another host is refused (delete the lock file once sure it is over).

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
                who = holder.describe()
                if holder.alive() is False:
                    who += f" (pid {holder.pid} has exited; processes it started still hold the lock)"
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
