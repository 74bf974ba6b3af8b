"""Child side of the code sandbox: isolate this process, then run the untrusted program in it.

Run by ``sandbox.run_sandboxed`` as ``python -I -S sandbox_boot.py SETTINGS_JSON STATUS_FD`` in a
new session, with an empty environment and a fresh temporary directory as cwd and HOME. It uses
the standard library only (``-S``: no site-packages) and imports nothing of ours, so it can be
started before anything else is trusted. In order it:

1. leaves the network: ``unshare(CLONE_NEWNET)`` through libc (Python 3.11 has no
   ``os.unshare``), so only an unconfigured loopback exists; needs CAP_SYS_ADMIN (root here);
   then makes the filesystem read-only except its temporary directory: a private mount
   namespace (``CLONE_NEWNS``, propagation private first so nothing reaches the host) in which
   the temporary directory is bind-mounted onto itself and every other mount is remounted
   read-only (device files such as /dev/null stay writable);
2. sets rlimits: CPU seconds, address space, file size, process count, open files, no core;
3. drops to an unprivileged uid (``nobody``) when root and told to (RLIMIT_NPROC is not
   enforced for uid 0);
4. reports what it achieved as one JSON line on STATUS_FD and closes it;
5. installs the Python guard (an audit hook) unless disabled: blocks socket creation (the
   network fallback when step 1 failed), process creation (fork/exec/spawn/system), loading
   ``ctypes``/``_posixsubprocess``, writes outside the temporary directory and reading other
   processes' ``/proc/PID`` files (their environment). The guard is defence in depth at the
   Python level; the kernel limits above and the parent's wall-clock kill are the hard walls;
6. runs ``main.py`` from the temporary directory as ``__main__``.
"""

import json
import os
import resource
import sys

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS = {"rdonly": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "remount": 32, "bind": 4096,
       "rec": 16384, "private": 1 << 18}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_BLOCKED_EVENTS = frozenset(
    {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
     "subprocess.Popen", "os.kill", "os.killpg", "socket.__new__", "ctypes.dlopen",
     "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
     "gc.get_objects", "gc.get_referrers", "gc.get_referents"}
)
_BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess"})
_PATH_EVENTS = frozenset(
    {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
     "os.chown", "os.truncate", "os.utime", "os.chdir", "shutil.rmtree", "os.mkfifo", "os.mknod"}
)


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _unshare_network() -> bool:
    try:
        return _libc().unshare(_CLONE_NEWNET) == 0
    except (OSError, AttributeError):
        return False


def _mount_points() -> list[tuple[bytes, int]]:
    """(mount point, flags to keep) of every mount, from /proc/self/mountinfo."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode("latin-1")  # \040 etc.
            keep = sum(_MS[o] for o in ("nosuid", "nodev", "noexec") if o in fields[5].split(","))
            points.append((point, keep))
    return points


def _readonly_filesystem(root: str) -> bool:
    """Everything but ``root`` read-only, in a private mount namespace. False when refused."""
    try:
        libc = _libc()
        if libc.unshare(_CLONE_NEWNS) != 0:
            return False
        if libc.mount(None, b"/", None, _MS["rec"] | _MS["private"], None) != 0:
            return False  # without private propagation a remount could reach the host: stop
        work = os.fsencode(root)
        if libc.mount(work, work, None, _MS["bind"], None) != 0:
            return False
        flags = _MS["remount"] | _MS["bind"] | _MS["rdonly"]
        ok = True
        for point, keep in _mount_points():
            if point != work and libc.mount(None, point, None, flags | keep, None) != 0:
                ok = ok and point.startswith((b"/proc", b"/sys"))  # pseudo-fs may refuse: fine
        os.chdir(root)  # the cwd must be the new writable mount, not the directory under it
        return ok
    except (OSError, AttributeError):
        return False


def _set_limits(s: dict) -> None:
    limits = [
        (resource.RLIMIT_CPU, s["cpu_seconds"]),
        (resource.RLIMIT_AS, s["memory_bytes"]),
        (resource.RLIMIT_FSIZE, s["file_size_bytes"]),
        (resource.RLIMIT_NPROC, s["max_processes"]),
        (resource.RLIMIT_NOFILE, s["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def _drop_privileges(s: dict) -> bool:
    if os.getuid() != 0 or s["uid"] < 0:
        return False
    os.setgroups([])
    os.setgid(s["gid"])
    os.setuid(s["uid"])
    return True


def _make_guard(root: str, own_pid: int):
    """The audit hook. Everything it uses is bound here, so user code that rebinds module
    globals or patches ``os.path`` cannot loosen it."""
    own_proc = (f"/proc/{own_pid}/", "/proc/self/", "/proc/thread-self/")
    blocked, blocked_imports, path_events = _BLOCKED_EVENTS, _BLOCKED_IMPORTS, _PATH_EVENTS
    realpath, fsdecode, write_flags, sep = os.path.realpath, os.fsdecode, _WRITE_FLAGS, os.sep

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor was vetted when it was opened
        try:
            full = realpath(fsdecode(path))
        except (TypeError, ValueError):
            return False
        return full == root or full.startswith(root + sep) or full == "/dev/null"

    def guard(event, args):
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in blocked_imports:
            raise PermissionError(f"sandbox: import {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            text = realpath(fsdecode(path)) if isinstance(path, (str, bytes)) else ""
            if text.startswith("/proc/") and not (text + "/").startswith(own_proc):
                raise PermissionError(f"sandbox: reading {text} is not allowed")
            writes = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & write_flags
            )
            if writes and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
        elif event in path_events:
            for path in args:
                if isinstance(path, (str, bytes)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} is not allowed")

    return guard


def main() -> None:
    settings = json.loads(sys.argv[1])
    status_fd = int(sys.argv[2])
    netns = settings["network_namespace"] and _unshare_network()
    readonly = settings["readonly_filesystem"] and _readonly_filesystem(os.path.realpath(os.getcwd()))
    _set_limits(settings)
    dropped = _drop_privileges(settings)
    status = {"netns": netns, "readonly_fs": readonly, "uid": os.getuid(),
              "dropped_privileges": dropped, "guard": settings["python_guard"]}
    with os.fdopen(status_fd, "w") as f:
        f.write(json.dumps(status) + "\n")
    _run_program(os.path.realpath(os.getcwd()), settings["python_guard"])


def _run_program(root: str, guard: bool) -> None:
    """Execute ``main.py`` as a fresh ``__main__`` module (this boot module leaves sys.modules)."""
    import types

    path = os.path.join(root, "main.py")
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = [path]
    sys.path[0] = root
    for name in [m for m in sys.modules if m.split(".")[0] in _BLOCKED_IMPORTS]:
        del sys.modules[name]  # imported by the isolation steps; the program must re-import
    if guard:
        sys.addaudithook(_make_guard(root, os.getpid()))
    exec(code, module.__dict__)


if __name__ == "__main__":
    main()
