"""Run untrusted, model-written Python so that the kernel, not Python, keeps it contained.

Parent side of the code sandbox (the child side is ``sandbox_boot.py``; the kernel calls are in
``sandbox_kernel.py`` and ``sandbox_seccomp.py``; the check harness in ``sandbox_harness.py``).
docs/sandbox.md has the threat model and which layer stops what. Every run gets, enforced by the
kernel:

- **its own mount, PID, network, IPC, UTS and cgroup namespaces** and a private root: read-only
  system directories and interpreter, no host files (no ``/etc/shadow``, no ``/work``), no
  network but an unconfigured loopback, no view of the worker's processes;
- **an unprivileged uid with no capabilities**: as root, a uid of its own per run
  (``uid_base`` + the boot process's pid, never a real user) set with setresuid; otherwise the
  worker's uid behind a user namespace (root inside maps to it, capabilities dropped, securebits
  locked). The program never runs as root;
- **a seccomp filter** (deny-list, see ``sandbox_seccomp``): no mount, namespace, ptrace,
  pidfd, bpf, keyctl, module, reboot, swap, perf, io_uring, process_vm_*, open_by_handle_at...,
  and signals only to its own processes;
- **rlimits** on CPU seconds, address space, file size, processes and open files, and a
  **total disk budget**: ``/tmp`` (cwd and HOME) is a tmpfs of ``disk_bytes``;
- **a cgroup of its own** where the kernel allows (``sandbox_cgroup``): the memory and the
  processes of the whole program, its children included, bounded together (``memory_bytes``,
  ``max_processes``); a run past its memory is OOM-killed and ``SandboxResult.memory_exceeded``;
- **a reaper that misses nothing**: the harness is the PID namespace's init; when it exits the
  kernel kills every process of the namespace (setsid daemons included). The boot process dies
  with the worker (PR_SET_PDEATHSIG) and the harness with the boot, so a SIGKILLed worker takes
  its sandboxes with it; their files live only in the namespace's tmpfs, gone with it;
- **a verdict the program cannot fake**: for a function check (HumanEval) the trusted test runs
  in the harness process, which calls the program's function over a pipe and reports on a pipe
  the program never holds (``FunctionCheck``, ``SandboxResult.passed``); the exit code and
  anything the program prints are not the verdict;
- a wall-clock limit (the whole tree is killed) and a cap on stdout and stderr.

Where the kernel refuses the namespaces (no root and no unprivileged user namespaces, or a
container's own seccomp profile), the first run (or ``sandbox_mode``, which the reward registry
calls at start-up) raises ``SandboxUnavailableError`` saying what to change, unless the user
set ``allow_degraded=True``: then runs keep the seccomp filter (stricter: no sockets, no new
processes, signals only to itself), the rlimits, a uid of their own when the worker is root,
the parent-death chain and the check harness, and lose the private root (host files are
readable and world-writable places writable), the disk cap and the network and PID isolation.
``SandboxResult.isolation`` says which mode ran; a warning is logged once.
"""

from __future__ import annotations

import logging
import marshal
import os
import re
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

if __package__:
    from megatron_darl.rewards.sandbox_cgroup import RunCgroup, cgroup_backend
else:  # loaded from its file alone (stdlib only: the tests' unprivileged worker, system python)
    import importlib.util

    _spec = importlib.util.spec_from_file_location("sandbox_cgroup", Path(__file__).with_name("sandbox_cgroup.py"))
    _cgroup = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_cgroup)
    RunCgroup, cgroup_backend = _cgroup.RunCgroup, _cgroup.cgroup_backend

log = logging.getLogger(__name__)

_BOOT = Path(__file__).with_name("sandbox_boot.py")
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                 "/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")


class SandboxUnavailableError(RuntimeError):
    """The kernel refused the isolation and degraded mode was not allowed."""


@dataclass
class SandboxConfig:
    """Limits and isolation of one sandboxed run."""

    wall_seconds: float = 10.0  # wall-clock limit; every process of the run is killed after it
    cpu_seconds: int = 10  # RLIMIT_CPU of each process
    memory_bytes: int = 1 << 30  # RLIMIT_AS of each process, and the whole run's memory (cgroup)
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file it may write
    disk_bytes: int = 64 << 20  # size of its tmpfs /tmp: all files together (namespaces only)
    disk_inodes: int = 4096  # files and directories it may create in /tmp
    max_processes: int = 32  # RLIMIT_NPROC of its uid and pids.max of its cgroup (harness included)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # cap on stdout and on stderr; exceeding it kills the run
    uid_base: int = 1_000_000_000  # as root, each run's uid is uid_base + its boot pid
    readonly_paths: tuple[str, ...] = _SYSTEM_PATHS  # host paths visible read-only (+ python)
    namespaces: bool = True  # False: skip the namespaces on purpose (needs allow_degraded)
    allow_degraded: bool = False  # run without namespaces where the kernel refuses them
    python: str = ""  # interpreter; "" = the running one (sys.executable)
    cgroup: str = "auto"  # a cgroup per run: "auto" (where the kernel allows), "require", "off"
    cgroup_parent: str = ""  # delegated cgroup v2 dir for the runs' cgroups; "" = the worker's own

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "file_size_bytes",
                     "disk_bytes", "disk_inodes", "max_processes", "max_open_files",
                     "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name}={getattr(self, name)!r}: must be > 0")
        if not 1000 <= self.uid_base <= 4_000_000_000:
            raise ValueError(f"SandboxConfig.uid_base={self.uid_base}: use an unused uid range "
                             "in [1000, 4e9] (each run takes uid_base + a pid)")
        if self.cgroup not in ("auto", "require", "off"):
            raise ValueError(f"SandboxConfig.cgroup={self.cgroup!r}: use 'auto', 'require' or 'off'")
        if not self.namespaces and not self.allow_degraded:
            raise ValueError("SandboxConfig.namespaces=False runs degraded: set allow_degraded=True")
        self.readonly_paths = tuple(self.readonly_paths)
        bad = [p for p in self.readonly_paths if not os.path.isabs(p) or os.path.normpath(p) == "/"]
        if bad:
            raise ValueError(f"SandboxConfig.readonly_paths must be absolute and not '/', got {bad}")


@dataclass(frozen=True)
class FunctionCheck:
    """A trusted test of one function the program defines, run by the sandbox's harness."""

    setup: str  # trusted code the test needs (the HumanEval prompt: imports, helpers)
    test: str  # trusted code that defines check(candidate)
    entry_point: str  # name of the program's function passed to check()


@dataclass
class SandboxResult:
    """What one run did."""

    returncode: int | None  # program's exit status; negative = its signal; None = not known
    stdout: str  # captured standard output (at most max_output_bytes)
    stderr: str  # captured standard error (at most max_output_bytes)
    timed_out: bool  # the wall-clock limit killed it
    output_truncated: bool  # the output cap killed it
    isolation: str  # "namespaces", "degraded", or "" when it never started
    uid: int  # host uid the program ran under (-1 when unknown)
    passed: bool | None = None  # a FunctionCheck's verdict, from the harness; None without one
    check_error: str = ""  # why the check failed (traceback tail from the harness)
    harness_error: str = ""  # the check's own (trusted) code failed: no verdict on the program
    memory_exceeded: bool = False  # the run's cgroup hit memory_bytes: the kernel OOM-killed in it
    cgroup: str = ""  # "v2" or "v1": the run had a cgroup of its own; "" = none
    memory_peak_bytes: int = -1  # most memory the whole run held at once (cgroup); -1 = unknown
    error: str = ""  # the sandbox itself failed (not the program); empty when it worked

    @property
    def ok(self) -> bool:
        """Within its limits and: the check passed (with a check) or it exited 0 (without)."""
        if (self.timed_out or self.output_truncated or self.memory_exceeded or self.error
                or self.harness_error):
            return False
        return bool(self.passed) if self.passed is not None else self.returncode == 0


_MODES: dict[tuple, str] = {}
_MODES_LOCK = threading.Lock()


def sandbox_mode(cfg: SandboxConfig | None = None) -> str:
    """The isolation runs under ``cfg`` get: "root", "userns" or "degraded" (probed once).

    Raises SandboxUnavailableError when the kernel refuses the namespaces and
    ``cfg.allow_degraded`` is not set. Call it at start-up to fail before the first reward.
    """
    cfg = cfg or SandboxConfig()
    python = os.path.realpath(cfg.python or sys.executable)
    key = (python, cfg.namespaces, cfg.allow_degraded, cfg.readonly_paths, cfg.cgroup, cfg.cgroup_parent)
    with _MODES_LOCK:
        if key not in _MODES:
            _check_cgroup(cfg)
            _MODES[key] = _probe(cfg, python)
        return _MODES[key]


def _check_cgroup(cfg: SandboxConfig) -> None:
    """Refuse (``cgroup="require"``) or say once (``"auto"``) when runs get no cgroup."""
    if cfg.cgroup == "off":
        return
    backend, why = cgroup_backend(cfg.cgroup_parent)
    if backend is not None:
        return
    if cfg.cgroup == "require":
        raise SandboxUnavailableError(
            f"code sandbox: {why}. SandboxConfig.cgroup='require' needs a cgroup per run: run the "
            "worker as root, or in a delegated cgroup v2 subtree (SandboxConfig.cgroup_parent), or "
            "set cgroup='auto' to run with per-process limits only (docs/sandbox.md, 'Known limits').")
    _warn_once(f"code sandbox without a cgroup per run: {why}. Memory and processes are bounded per "
               "process only (RLIMIT_AS, RLIMIT_NPROC): a run may use up to max_processes x "
               "memory_bytes (docs/sandbox.md, 'Known limits')")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


def _run_cgroup(cfg: SandboxConfig) -> RunCgroup | None:
    """A fresh cgroup for one run, or None where runs get none (see ``_check_cgroup``)."""
    backend = cgroup_backend(cfg.cgroup_parent)[0] if cfg.cgroup != "off" else None
    if backend is None:
        return None
    return RunCgroup(backend, cfg.memory_bytes, cfg.max_processes + 1)  # + the boot


def _probe(cfg: SandboxConfig, python: str) -> str:
    reason = "SandboxConfig.namespaces=False"
    if cfg.namespaces:
        mode = "root" if os.geteuid() == 0 else "userns"
        result = _run(python, mode, "print('ok')", "", cfg, None)
        if result.stdout == "ok\n" and result.isolation == "namespaces":
            return mode
        reason = result.error or f"probe failed: {result.stderr[-500:]!r}"
        if not cfg.allow_degraded:
            raise SandboxUnavailableError(
                f"code sandbox: {reason}. Untrusted code needs its own mount, PID and network "
                "namespaces: run the rollout worker as root, or allow unprivileged user "
                "namespaces (sysctl user.max_user_namespaces>0, kernel.unprivileged_userns_clone"
                "=1, on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0), or set "
                "SandboxConfig.allow_degraded=True to run with seccomp, rlimits and a group "
                "kill only (docs/sandbox.md, 'Degraded mode').")
    if os.geteuid() == 0 and not _world_reachable(Path(python)):
        raise SandboxUnavailableError(
            f"code sandbox: {reason}, and degraded mode cannot drop root: {python} is not "
            "readable by an unprivileged uid. Set SandboxConfig.python to an interpreter "
            "outside root-only directories (e.g. /usr/bin/python3).")
    if os.geteuid() != 0:
        _close_proc_files()
    log.warning("code sandbox DEGRADED (%s): no private root, disk cap, network or PID "
                "isolation; seccomp, rlimits and the group kill remain (docs/sandbox.md)", reason)
    return "degraded"


def _close_proc_files() -> None:
    """Degraded mode under a non-root worker runs programs as the worker's uid, which may open
    the worker's ``/proc/PID/environ``, ``mem`` and ``fd/``: the worker turns non-dumpable, so
    the kernel closes them to every process without CAP_SYS_PTRACE (debuggers of this uid
    included; core dumps are off)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise SandboxUnavailableError(
            f"code sandbox: degraded mode cannot close this worker's /proc files to its programs: "
            f"prctl(PR_SET_DUMPABLE): {os.strerror(ctypes.get_errno())}")
    log.warning("code sandbox: this worker is now non-dumpable (its programs share its uid)")


def run_sandboxed(program: str, stdin: str = "", cfg: SandboxConfig | None = None,
                  check: FunctionCheck | None = None) -> SandboxResult:
    """Run the Python source ``program`` with ``stdin`` as its input under ``cfg``'s limits.

    With ``check``, the harness runs ``check.test`` against ``program``'s ``entry_point`` and
    ``SandboxResult.passed`` is its verdict. Never raises for anything the program does; raises
    SandboxUnavailableError when the kernel refuses the isolation (see ``sandbox_mode``).
    """
    cfg = cfg or SandboxConfig()
    python = os.path.realpath(cfg.python or sys.executable)
    mode = sandbox_mode(cfg)
    result = _run(python, mode, program, stdin, cfg, check)
    if result.error:
        log.warning("code sandbox: %s", result.error)
    return result


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _settings(cfg: SandboxConfig, mode: str, workdir: str, cgroup: RunCgroup | None) -> dict:
    return {
        "cgroup_procs": cgroup.procs_files if cgroup is not None else [],
        "mode": mode, "wall_seconds": cfg.wall_seconds, "cpu_seconds": cfg.cpu_seconds,
        "memory_bytes": cfg.memory_bytes, "file_size_bytes": cfg.file_size_bytes,
        "disk_bytes": cfg.disk_bytes, "disk_inodes": cfg.disk_inodes,
        "max_processes": cfg.max_processes, "max_open_files": cfg.max_open_files,
        "uid_base": cfg.uid_base, "readonly_paths": list(cfg.readonly_paths), "workdir": workdir,
    }


def _run(python: str, mode: str, program: str, stdin: str, cfg: SandboxConfig,
         check: FunctionCheck | None) -> SandboxResult:
    try:
        cgroup = _run_cgroup(cfg)
    except OSError as exc:
        return SandboxResult(None, "", "", False, False, "", -1,
                             error=f"could not create the run's cgroup: {exc}")
    oom_kills, peak = 0, -1
    try:
        workdir = _degraded_workdir() if mode == "degraded" else ""
        outcome = _start_and_supervise(python, mode, program, stdin, cfg, check, workdir, cgroup)
    finally:
        if cgroup is not None:
            oom_kills, peak = cgroup.oom_kills(), cgroup.memory_peak()
            cgroup.close()  # kills whatever of the run is left, removes the cgroup
    result = _result(*outcome, oom_kills)
    if cgroup is not None:
        result.cgroup, result.memory_peak_bytes = f"v{cgroup.backend.version}", peak
    return result


def _start_and_supervise(python: str, mode: str, program: str, stdin: str, cfg: SandboxConfig,
                         check: FunctionCheck | None, workdir: str, cgroup: RunCgroup | None):
    """Start the boot with the job, supervise it; (events, stdout, stderr, timed_out, truncated)."""
    home = workdir or "/tmp"
    job = {"settings": _settings(cfg, mode, workdir, cgroup), "program": program, "stdin": stdin,
           "entry_point": check.entry_point if check else ""}
    fds = [_memfd("darl_sandbox_job", marshal.dumps(job, 4))]
    if check is not None:
        fds.append(_memfd("darl_sandbox_check", marshal.dumps(dict(check.__dict__), 4)))
    status_r, status_w = os.pipe()
    fds.append(status_w)
    try:
        argv = [python, "-I", "-S", str(_BOOT), str(status_w),
                str(fds[1] if check is not None else -1), str(os.getpid())]
        proc = subprocess.Popen(
            argv, stdin=fds[0], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
            env={"HOME": home, "TMPDIR": home, "LC_ALL": "C.UTF-8"}, start_new_session=True,
            pass_fds=tuple(fds[1:]), close_fds=True)
        for fd in fds:
            os.close(fd)
        fds = []
        stdout, stderr, timed_out, truncated = _supervise(proc, cfg)
        events = _read_status(status_r)
    finally:
        for fd in fds + [status_r]:
            os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return events, stdout, stderr, timed_out, truncated


def _result(events: list[dict], stdout: bytes, stderr: bytes, timed_out: bool,
            truncated: bool, oom_kills: int = 0) -> SandboxResult:
    started = next((e for e in events if e.get("event") == "started"), {})
    done = next((e for e in events if e.get("event") == "done"), {})
    refused = next((e for e in events if e.get("event") == "refused"), None)
    error = ""
    if refused is not None:
        error = f"the kernel refused the sandbox's {refused.get('stage')}: {refused.get('error')}"
    elif not done and not (timed_out or truncated or oom_kills):
        error = "the sandbox's harness died without a verdict"
    return SandboxResult(
        returncode=done.get("returncode"),
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        timed_out=timed_out, output_truncated=truncated,
        isolation=started.get("isolation", ""), uid=int(started.get("uid", -1)),
        passed=done.get("passed"), check_error=done.get("check_error", ""),
        harness_error=done.get("harness_error", ""), memory_exceeded=oom_kills > 0, error=error)


def _read_status(fd: int) -> list[dict]:
    """Every event the boot and harness sent (they have exited: the pipe is at EOF)."""
    os.set_blocking(fd, False)
    data = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    events, pos = [], 0
    while pos + 4 <= len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        try:
            event = marshal.loads(bytes(data[pos + 4:pos + 4 + size]))
        except (EOFError, ValueError, TypeError):
            break
        if isinstance(event, dict):
            events.append(event)
        pos += 4 + size
    return events


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
        time.sleep(0.002)


def _supervise(proc: subprocess.Popen, cfg: SandboxConfig):
    """Collect output, enforce the deadline, and kill whatever is left.

    A boot still running at the end gets SIGTERM: it SIGKILLs the harness, the PID namespace's
    init, and waits until the kernel has killed and reaped the whole namespace, so that when
    this returns no process of the run exists. If it does not exit within 2 s its group (the
    boot and the harness) is SIGKILLed. The boot is alive or an unreaped zombie when the group
    is signalled, so the group id cannot belong to a stranger. In degraded mode the program is
    a single process (its filter refuses fork) that dies with the harness (PR_SET_PDEATHSIG).
    """
    deadline = time.monotonic() + cfg.wall_seconds
    try:
        stdout, stderr, timed_out, truncated = _collect(proc, cfg, deadline)
        if not (timed_out or truncated) and not _exited_by(proc.pid, deadline):
            timed_out = True
    finally:
        if not _exited_by(proc.pid, time.monotonic()):
            os.kill(proc.pid, signal.SIGTERM)  # the boot kills the harness and waits for it
            _exited_by(proc.pid, time.monotonic() + 2.0)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever did not go
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    return stdout, stderr, timed_out, truncated


_SWEPT = threading.Event()


def _degraded_workdir() -> str:
    """A host directory for a degraded run; stale ones of dead workers are removed first."""
    if not _SWEPT.is_set():
        _SWEPT.set()
        pattern = re.compile(r"darl_sandbox_(\d+)_")
        for entry in Path(tempfile.gettempdir()).glob("darl_sandbox_*"):
            match = pattern.match(entry.name)
            if match and not _alive(int(match.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
    path = tempfile.mkdtemp(prefix=f"darl_sandbox_{os.getpid()}_")
    os.chmod(path, 0o755)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _world_reachable(path: Path) -> bool:
    """True when every directory above ``path`` is searchable and the file readable by others."""
    path = path.resolve()
    for parent in list(path.parents)[::-1]:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)
