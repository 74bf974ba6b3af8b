"""Run untrusted, model-written Python without letting it hurt the rollout worker.

Parent side of the sandbox (the child side, which isolates itself before running the program,
is ``sandbox_boot.py``). Each run gets:

- its own session and process group (``start_new_session``), killed as a whole (SIGKILL to the
  group, then to any descendant that left it) when the wall-clock limit passes;
- rlimits on CPU seconds, address space, file size, process count and open files, set by the
  child before the program starts;
- a fresh temporary directory as cwd, HOME and TMPDIR, removed afterwards;
- an empty environment (only HOME, TMPDIR and a UTF-8 locale), ``python -I -S`` (no user or
  site packages, no PYTHON* variables);
- no network: a fresh network namespace (``unshare(CLONE_NEWNET)``, needs root or
  CAP_SYS_ADMIN); when that is refused the Python audit-hook guard that blocks socket creation
  is what keeps the program offline. ``SandboxResult.network_isolation`` says which one held;
- no writes outside its directory: a private mount namespace where every mount but the
  temporary directory is read-only (same privilege needed), else the guard's write check
  (``SandboxResult.filesystem_isolation``);
- an unprivileged uid (``nobody``) when we are root and the interpreter is readable by it
  (RLIMIT_NPROC only binds non-root users); otherwise the guard's ban on fork/exec stops forks;
- stdout/stderr capped at ``max_output_bytes``: past the cap the group is killed.
"""

from __future__ import annotations

import json
import os
import pwd
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import psutil

_BOOT = Path(__file__).with_name("sandbox_boot.py")


@dataclass
class SandboxConfig:
    """Limits for one sandboxed run."""

    wall_seconds: float = 10.0  # wall-clock limit; the whole process group is killed after it
    cpu_seconds: int = 10  # RLIMIT_CPU of the program
    memory_bytes: int = 1 << 30  # RLIMIT_AS (address space) of the program
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file it may write
    max_processes: int = 32  # RLIMIT_NPROC (binds only when running under a non-root uid)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # cap on stdout and on stderr; exceeding it kills the run
    network_namespace: bool = True  # try unshare(CLONE_NEWNET) (falls back to the guard)
    readonly_filesystem: bool = True  # try a mount namespace with all but the temp dir read-only
    drop_privileges: bool = True  # when root, run as `nobody` if the interpreter allows it
    python_guard: bool = True  # audit hook: no sockets, fork/exec, ctypes, writes outside tmp
    python: str = ""  # interpreter; "" = the running one (sys.executable)


@dataclass
class SandboxResult:
    """What one run did."""

    returncode: int | None  # exit status; negative = killed by that signal; None = never ran
    stdout: str  # captured standard output (at most max_output_bytes)
    stderr: str  # captured standard error (at most max_output_bytes)
    timed_out: bool  # the wall-clock limit killed it
    output_truncated: bool  # the output cap killed it
    network_isolation: str  # "netns" or "audit_hook" (or "none" when both are disabled)
    filesystem_isolation: str  # "mountns" (read-only but the temp dir), "audit_hook" or "none"
    uid: int  # uid the program ran under

    @property
    def ok(self) -> bool:
        """Exited 0 within its limits."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


def _world_reachable(path: Path) -> bool:
    """True when every directory above ``path`` is searchable and the file readable by others."""
    path = path.resolve()
    for parent in list(path.parents)[::-1]:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)


@lru_cache(maxsize=8)
def _stdlib_of(python: str) -> Path | None:
    """Where ``python`` keeps ``os.py`` (None when the interpreter cannot be run)."""
    try:
        out = subprocess.run([python, "-I", "-S", "-c", "import os; print(os.__file__)"],
                             capture_output=True, text=True, env={}, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def _unprivileged_ids(cfg: SandboxConfig, python: str) -> tuple[int, int]:
    if not cfg.drop_privileges or os.getuid() != 0:
        return -1, -1
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return -1, -1
    stdlib = _stdlib_of(python)
    if stdlib is None or not (_world_reachable(Path(python)) and _world_reachable(stdlib)):
        return -1, -1  # e.g. a pyenv interpreter under /root (0700): stay root, guard on
    return nobody.pw_uid, nobody.pw_gid


def _settings(cfg: SandboxConfig, uid: int, gid: int) -> str:
    return json.dumps(
        {"cpu_seconds": cfg.cpu_seconds, "memory_bytes": cfg.memory_bytes,
         "file_size_bytes": cfg.file_size_bytes, "max_processes": cfg.max_processes,
         "max_open_files": cfg.max_open_files, "network_namespace": cfg.network_namespace,
         "readonly_filesystem": cfg.readonly_filesystem,
         "python_guard": cfg.python_guard, "uid": uid, "gid": gid}
    )


def _kill_tree(proc: subprocess.Popen, descendants: list[psutil.Process]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in descendants:  # those that called setsid() and left the group
        try:
            child.kill()
        except psutil.Error:
            pass


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _collect(proc: subprocess.Popen, cfg: SandboxConfig, deadline: float):
    """Read both pipes until EOF, the deadline or the output cap.

    Returns (stdout, stderr, timed_out, truncated).
    """
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in out:
        sel.register(pipe, selectors.EVENT_READ)
    timed_out = truncated = False
    while sel.get_map() and not truncated:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(remaining, 0.5)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = out[key.fileobj]
            buf += chunk
            if len(buf) > cfg.max_output_bytes:
                del buf[cfg.max_output_bytes:]
                truncated = True
    sel.close()
    return bytes(out[proc.stdout]), bytes(out[proc.stderr]), timed_out, truncated


def _exited_by(pid: int, deadline: float) -> bool:
    """Wait (without reaping, so the pid and its group id stay reserved) until exit or deadline."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _supervise(proc: subprocess.Popen, cfg: SandboxConfig):
    """Collect output, enforce the deadline, and kill whatever is left of the group."""
    deadline = time.monotonic() + cfg.wall_seconds
    try:
        stdout, stderr, timed_out, truncated = _collect(proc, cfg, deadline)
        if not (timed_out or truncated) and not _exited_by(proc.pid, deadline):
            timed_out = True
    finally:
        # The leader is alive or an unreaped zombie here, so its group id cannot be reused:
        # killing the group always hits our processes (daemons included), never a stranger.
        _kill_tree(proc, _descendants(proc.pid))
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return stdout, stderr, timed_out, truncated


def _prepare_dir(program: str, stdin: str, uid: int, gid: int) -> Path:
    """``top/`` (ours: stdin file) and ``top/work/`` (the program's cwd and HOME)."""
    top = Path(tempfile.mkdtemp(prefix="darl_sandbox_"))
    work = top / "work"
    work.mkdir()
    (work / "main.py").write_text(program, encoding="utf-8")
    (top / "stdin").write_text(stdin, encoding="utf-8")
    if uid >= 0:
        os.chown(work, uid, gid)
        os.chown(work / "main.py", uid, gid)
        top.chmod(0o755)
    return top


def run_sandboxed(program: str, stdin: str = "", cfg: SandboxConfig | None = None) -> SandboxResult:
    """Run the Python source ``program`` with ``stdin`` as its input under ``cfg``'s limits.

    Never raises for anything the program does; all of it ends up in the result.
    """
    cfg = cfg or SandboxConfig()
    python = cfg.python or sys.executable
    uid, gid = _unprivileged_ids(cfg, python)
    top = _prepare_dir(program, stdin, uid, gid)
    work = top / "work"
    env = {"HOME": str(work), "TMPDIR": str(work), "LC_ALL": "C.UTF-8"}
    status_r, status_w = os.pipe()
    try:
        with open(top / "stdin", "rb") as stdin_file:
            proc = subprocess.Popen(
                [python, "-I", "-S", str(_BOOT), _settings(cfg, uid, gid), str(status_w)],
                stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work,
                env=env, start_new_session=True, pass_fds=(status_w,), close_fds=True,
            )
        os.close(status_w)
        status_w = -1
        stdout, stderr, timed_out, truncated = _supervise(proc, cfg)
        with os.fdopen(status_r, "r") as f:
            status_r = -1
            line = f.readline()
        status = json.loads(line) if line else {}
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(top, ignore_errors=True)
    return SandboxResult(
        returncode=proc.returncode,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        timed_out=timed_out,
        output_truncated=truncated,
        network_isolation=_isolation(status.get("netns"), "netns", cfg),
        filesystem_isolation=_isolation(status.get("readonly_fs"), "mountns", cfg),
        uid=int(status.get("uid", -1)),
    )


def _isolation(kernel: bool | None, name: str, cfg: SandboxConfig) -> str:
    if kernel:
        return name
    return "audit_hook" if cfg.python_guard else "none"
