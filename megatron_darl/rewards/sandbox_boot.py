"""Child side of the code sandbox: build the isolation, then run the untrusted program in it.

``sandbox.run_sandboxed`` starts ``python -I -S sandbox_boot.py STATUS_FD CHECK_FD PARENT_PID``
with the job (settings, program, its stdin; ``marshal``) on stdin. Three processes follow:

1. **boot** (this process, in the worker's namespaces): dies with the worker
   (PR_SET_PDEATHSIG), joins the run's cgroup (``sandbox_cgroup``; when it has one, every
   process of the run is born in it), creates the mount, network, PID, IPC, UTS and cgroup
   namespaces (as root;
   otherwise with a user namespace that maps root inside to the worker's uid), forks the harness
   and waits for it. A refusal of the kernel is reported as a ``refused`` event. SIGTERM (the
   worker's deadline) makes it SIGKILL the harness and wait: when the boot exits, every process
   of the sandbox is gone.
2. **harness** (PID 1 of the new PID namespace): builds the private root
   (``sandbox_kernel.build_root``: read-only system dirs, a size-capped tmpfs ``/tmp``), sets
   the rlimits, drops to an unprivileged uid with no capabilities (as root: a uid of its own,
   ``uid_base`` + the boot's pid, so RLIMIT_NPROC and kill(-1) cover this sandbox only), turns
   non-dumpable (the program can neither ptrace it nor open its /proc files), installs the base
   seccomp filter and forks the program. It then waits for the program to exit or, for a
   function check, runs the trusted test against it (``sandbox_harness``; the test is read from
   CHECK_FD only after the fork, so the program's memory never held it). Last it kills every
   other process of the namespace and reports a ``done`` event on STATUS_FD, a pipe the
   program never holds. As the namespace's init it cannot be signalled by the program (the
   kernel drops such signals and the program's filter refuses them), and when it exits the
   kernel kills whatever is left in the namespace, setsid daemons included.
3. **program**: its own session, stdin from a memfd, every other descriptor closed, a seccomp
   filter of its own (signals only to its own processes), then ``main.py`` as ``__main__`` in
   this same interpreter (forked: no second interpreter start-up).

Degraded mode (``"mode": "degraded"``, only when the user allowed it): no namespaces; the
harness works in a host directory the parent made, the program runs under an unprivileged uid
of its own when the worker is root, with the stricter seccomp variant (no sockets, no new
processes, signals only to itself), and dies with the harness (PR_SET_PDEATHSIG).

Start-up cost matters (one boot per reward), so this imports only C modules besides the
``sandbox_*`` modules next to it (``ctypes`` is the one real cost); JSON (and ``typing``, which
the harness and the program of a HumanEval check both import) is loaded only for function
checks, once, before the forks. Events are length-prefixed ``marshal`` dicts: only the trusted
boot and harness ever write them.
"""

from __future__ import annotations

import _signal as signal
import marshal
import os
import select
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sandbox_kernel as kernel  # noqa: E402
import sandbox_seccomp as seccomp  # noqa: E402

_PROGRAM = "main.py"
_CHECK_GRACE = 0.5  # seconds the program gets to exit after the verdict (then it is killed)


def _join_cgroup(procs_files: list[str]) -> None:
    """Move this process into the run's cgroup (one ``cgroup.procs`` per hierarchy), before the
    namespaces (its cgroup namespace is rooted there) and before any fork: every process of
    the run is born in it."""
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _send(fd: int, **event) -> None:
    """One event on the status pipe: 4-byte length, then a marshal'd dict of plain values."""
    data = marshal.dumps(event, 4)
    os.write(fd, struct.pack("<I", len(data)) + data)


def _bind_paths(settings: dict) -> list[str]:
    """Read-only binds: the configured system paths plus this interpreter's prefixes, minus
    any path already inside another bound directory."""
    paths = list(settings["readonly_paths"])
    for prefix in (sys.base_prefix, sys.base_exec_prefix):
        real = os.path.realpath(prefix)
        if real not in paths:
            paths.append(real)
    dirs = [p for p in paths if os.path.isdir(p) and not os.path.islink(p)]
    return [p for p in paths
            if not any(p != d and p.startswith(d.rstrip("/") + "/") for d in dirs)]


def _set_limits(s: dict) -> None:
    """Soft = hard = the configured value, or the inherited hard limit where that is lower
    (raising it needs CAP_SYS_RESOURCE of the host, which a user namespace does not give)."""
    import resource

    for which, value in ((resource.RLIMIT_CPU, s["cpu_seconds"]),
                         (resource.RLIMIT_AS, s["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, s["file_size_bytes"]),
                         (resource.RLIMIT_NPROC, s["max_processes"]),
                         (resource.RLIMIT_NOFILE, s["max_open_files"]),
                         (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def _workdir(s: dict, files: dict, uid: int) -> None:
    """Degraded mode: the parent's host directory, handed to the sandbox uid."""
    os.chdir(s["workdir"])
    for name, data in files.items():
        with open(name, "wb") as f:
            f.write(data)
        if os.getuid() == 0:
            os.chown(name, uid, uid)
    if os.getuid() == 0:
        os.chown(".", uid, uid)


def _isolate(s: dict, program: str, host_uid: int) -> dict:
    """Harness, before the program exists: root, limits, uid, seccomp. Raises OSError."""
    mode, files = s["mode"], {_PROGRAM: program.encode()}
    if mode == "degraded":
        _workdir(s, files, host_uid)
    else:
        inner = host_uid if mode == "root" else 0  # userns: root inside is the worker outside
        kernel.build_root(_bind_paths(s), s["disk_bytes"], s["disk_inodes"], inner, inner, files)
    _set_limits(s)
    switch = mode == "root" or (mode == "degraded" and os.getuid() == 0)
    if switch:
        kernel.drop_privileges(host_uid, host_uid, switch_uid=True)
    elif mode == "userns":
        kernel.drop_privileges(0, 0, switch_uid=False)
    kernel.die_with_parent()  # a uid change clears it
    kernel.set_dumpable(False)
    seccomp.install(seccomp.base_filter(degraded=mode == "degraded"))
    return {"isolation": "degraded" if mode == "degraded" else "namespaces", "uid": host_uid,
            "cap_eff": kernel.effective_caps(), "own_uid": mode != "degraded" or switch}


def _program_side(s: dict, stdin_fd: int, keep: tuple[int, ...]) -> None:
    """In the forked program process: its own session, clean descriptors, its own filter."""
    os.setsid()
    kernel.set_dumpable(True)
    kernel.die_with_parent()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGALRM, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(stdin_fd, 0)
    try:  # the kernel's OOM killer takes the program's processes before the harness
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(fd, b"1000")
        os.close(fd)
    except OSError:
        pass
    low = 3
    for fd in sorted(keep) + [1 << 16]:
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    seccomp.install(seccomp.program_filter(os.getpid(), degraded=s["mode"] == "degraded"))


def _wait_program(pid: int, wakeup_fd: int, alive_fd: int, deadline: float) -> int | None:
    """Harness: the program's exit status (negative: killed by that signal), or None at the
    deadline or when the boot process died. The program stays unreaped (WNOWAIT), so its pid
    and process group id cannot be reused before ``_kill_all``."""
    while True:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([wakeup_fd, alive_fd], [], [], left)
        if alive_fd in ready:
            return None
        if wakeup_fd in ready:
            os.read(wakeup_fd, 4096)


def _kill_all(own_uid: bool, pid: int) -> None:
    """Harness: kill what is left of the program. As a PID namespace's init, or under a uid
    no other process has, kill(-1) reaches exactly the sandbox's processes; otherwise (degraded
    mode under the worker's uid) the program's group, which its filter keeps everyone in."""
    try:
        if own_uid:
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _judge(check_fd: int, calls_w: int, answers_r: int, deadline: float) -> tuple[bool, str, bool]:
    """Harness: run the trusted check (read only now, after the fork) against the program."""
    import sandbox_harness

    check = marshal.loads(_read_fd(check_fd))
    channel = sandbox_harness.Channel(answers_r, calls_w, deadline)
    return sandbox_harness.run_check(check["setup"], check["test"], check["entry_point"], channel)


def _harness(s: dict, job: dict, status_fd: int, check_fd: int, alive_fd: int, host_uid: int):
    """PID 1 of the sandbox. Returns only in the forked program process."""
    kernel.die_with_parent()
    if select.select([alive_fd], [], [], 0)[0]:
        os._exit(0)  # the boot died before we could follow it
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    deadline = time.monotonic() + s["wall_seconds"] + 1.0
    stdin_fd = os.memfd_create("stdin")  # before RLIMIT_FSIZE, which binds memfds too
    os.write(stdin_fd, job["stdin"].encode())
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    try:
        info = _isolate(s, job["program"], host_uid)
    except OSError as exc:
        _send(status_fd, event="refused", stage="isolation", error=str(exc))
        os._exit(0)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    checking = check_fd >= 0
    calls_r, calls_w = os.pipe() if checking else (-1, -1)
    answers_r, answers_w = os.pipe() if checking else (-1, -1)
    pid = os.fork()
    if pid == 0:
        _program_side(s, stdin_fd, (calls_r, answers_w) if checking else ())
        return job["entry_point"], calls_r, answers_w
    try:
        _send(status_fd, event="started", pid=pid, **info)
        passed, why, broken = None, "", False
        if checking:
            os.close(calls_r)
            os.close(answers_w)
            passed, why, broken = _judge(check_fd, calls_w, answers_r, deadline)
            os.close(calls_w)  # EOF: the program stops serving and exits, flushing its output
            deadline = min(deadline, time.monotonic() + _CHECK_GRACE)
        code = _wait_program(pid, wake_r, alive_fd, deadline)
        _kill_all(info["own_uid"], pid)
        _send(status_fd, event="done", returncode=code, passed=passed,
              check_error="" if broken else why, harness_error=why if broken else "")
    finally:
        os._exit(0)  # never unwind into the program's path, whatever happened


def main():
    """Boot process. Returns only in the program process: (entry point, calls fd, answers fd)
    of a function check, ("", -1, -1) for a plain run."""
    status_fd, check_fd, parent = (int(a) for a in sys.argv[1:4])
    kernel.die_with_parent()
    if os.getppid() != parent:
        os._exit(70)  # the worker died before we were told to follow it
    job = marshal.loads(_read_fd(0))
    settings = job["settings"]
    if check_fd >= 0:  # load now, while this directory is still visible; typing too, since
        import sandbox_harness  # noqa: F401 - nearly every HumanEval prompt imports it and both
        import typing  # noqa: F401 - the harness and the program would load it after the fork
    import gc

    gc.freeze()  # what the forks inherit stays out of their collections (fewer copied pages)
    signal.alarm(int(settings["wall_seconds"]) + 5)  # backstop: the worker kills us sooner
    host_uid = settings["uid_base"] + os.getpid() if os.getuid() == 0 else os.getuid()
    try:
        _join_cgroup(settings["cgroup_procs"])
    except OSError as exc:
        _send(status_fd, event="refused", stage="cgroup", error=str(exc))
        os._exit(0)
    try:
        if settings["mode"] == "root":
            kernel.unshare(kernel.NAMESPACES)
        elif settings["mode"] == "userns":
            uid, gid = os.getuid(), os.getgid()
            kernel.unshare(kernel.NAMESPACES | kernel.CLONE_NEWUSER)
            kernel.map_own_ids(uid, gid)
    except OSError as exc:
        _send(status_fd, event="refused", stage="namespaces", error=str(exc))
        os._exit(0)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        return _harness(settings, job, status_fd, check_fd, alive_r, host_uid)
    os.close(alive_r)
    for sig in (signal.SIGTERM, signal.SIGALRM):  # the worker's "stop now", or our backstop:
        signal.signal(sig, lambda *_: os.kill(pid, signal.SIGKILL))  # the harness's death
    os.waitpid(pid, 0)  # returns once the kernel has killed and reaped its whole namespace
    os._exit(0)


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with for this SystemExit."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _run_program(entry_point: str, calls_fd: int, answers_fd: int) -> None:
    """Execute ``main.py`` as a fresh ``__main__``; for a check, then answer the harness.

    Ends like the interpreter would (non-daemon threads joined, atexit hooks run, stdio
    flushed, SystemExit's status) but skips module teardown: a forked interpreter full of
    the boot's modules has nothing to tear down that matters, and it is the slow part."""
    import _sitebuiltins
    import builtins
    import types

    builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
    builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    path = os.path.join(os.getcwd(), _PROGRAM)
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = [path]
    sys.path[0] = os.getcwd()
    try:
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
        exec(code, module.__dict__)
        if entry_point:
            sys.modules["sandbox_harness"].serve(module.__dict__, entry_point, calls_fd, answers_fd)
        status = 0
    except SystemExit as exc:
        status = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - the program's own error: report it like Python does
        kind, value, tb = sys.exc_info()
        tb = tb.tb_next or tb  # start at the program, not at this function
        sys.excepthook(kind, value.with_traceback(tb), tb)
        status = 1
    _finish(status)


def _finish(status: int) -> None:
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exc:
        status = _exit_code(exc)
    except BaseException:  # noqa: BLE001
        sys.excepthook(*sys.exc_info())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stdout: nothing left to say
            pass
    os._exit(status)


if __name__ == "__main__":
    _run_program(*main())
