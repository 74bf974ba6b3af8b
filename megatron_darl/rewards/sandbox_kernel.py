"""Kernel-side isolation of the code sandbox: namespaces, a private root, no privileges.

Python 3.11 has no ``os.unshare``, ``mount`` or ``pivot_root``, so these are thin ctypes calls
into libc. Imported by ``sandbox_boot`` inside the sandbox: stdlib only, nothing of ours.

The root the program sees (``build_root``) is a fresh tmpfs, so nothing of the host is visible
unless bound into it on purpose:

- read-only, nosuid, nodev bind mounts of the system directories a Python interpreter needs
  (``/usr``, ``/lib*``, ``/etc/ld.so.cache`` ...) and of the interpreter's own prefix, at the
  same paths (the interpreter may live under a root-only directory such as ``/root/.pyenv``:
  the parent directories are recreated world-searchable on the tmpfs, so the sandbox uid can
  reach it without reaching anything else there);
- ``/tmp``: a size- and inode-capped tmpfs owned by the sandbox uid, its cwd and HOME. It is the
  only writable place and is the total disk budget; it lives in the sandbox's private mount
  namespace, so it vanishes with the namespace's last process, even after a SIGKILL of
  everything above it (no temp dir is ever left behind);
- ``/proc`` of the sandbox's own PID namespace (pids only), a minimal ``/dev`` (null, zero,
  full, random, urandom) and a generated ``/etc/passwd``, ``/etc/group``, ``/etc/hosts``;
- the tmpfs root itself is remounted read-only last.
"""

from __future__ import annotations

import ctypes
import errno
import os

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS = 1, 4, 24, 28
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_SECUREBITS_LOCKED_DOWN = 0xE3  # NOROOT(+locked), KEEP_CAPS locked off, no ambient raise(+locked)
_DEVICES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2", "shm": "/tmp"}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


def _check(ret: int, what: str) -> None:
    if ret != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def unshare(flags: int) -> None:
    """Move the calling (single-threaded) process into new namespaces of ``flags``."""
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def prctl(option: int, arg: int, what: str) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), what)


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits (cleared by fork and by uid changes)."""
    prctl(_PR_SET_PDEATHSIG, 9, "prctl(PR_SET_PDEATHSIG)")


def set_dumpable(on: bool) -> None:
    """Off: other processes of the same uid can neither ptrace nor open our /proc files."""
    prctl(_PR_SET_DUMPABLE, int(on), "prctl(PR_SET_DUMPABLE)")


def map_own_ids(uid: int, gid: int) -> None:
    """In a fresh user namespace: map root inside to our own uid/gid outside (the only mapping
    an unprivileged process may write); setgroups is denied first, as the kernel requires."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _mount(src, dst, fstype, flags: int, data: str | None = None) -> None:
    enc = [None if v is None else os.fsencode(v) for v in (src, dst, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {src} on {dst}")


def _mkdirs(root: str, path: str) -> str:
    """Create ``root/path`` (0755 dirs) and return it."""
    target = os.path.join(root, path.lstrip("/"))
    os.makedirs(target, mode=0o755, exist_ok=True)
    return target


def _bind_readonly(fd: int, target: str) -> None:
    _mount(f"/proc/self/fd/{fd}", target, None, _MS_BIND)
    noexec = _MS_NOEXEC if os.statvfs(target).f_flag & os.ST_NOEXEC else 0  # locked in a userns
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | noexec)


def _open_sources(paths) -> list[tuple[str, str | int]]:
    """(path, symlink text or O_PATH fd) of each existing path, opened before anything is
    mounted over the host's view (the fds keep working when their path is hidden)."""
    out = []
    for path in paths:
        if os.path.islink(path) and os.path.dirname(os.path.abspath(path)) == "/":
            out.append((path, os.readlink(path)))  # /bin -> usr/bin: recreate the link
        elif os.path.exists(path):
            out.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC)))
    return out


def _populate_dev(root: str) -> None:
    dev = _mkdirs(root, "/dev")
    for name in _DEVICES:
        target = os.path.join(dev, name)
        open(target, "w").close()
        _mount(f"/dev/{name}", target, None, _MS_BIND)
        _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NOEXEC)
    for name, dest in _DEV_LINKS.items():
        os.symlink(dest, os.path.join(dev, name))


def _write_etc(root: str, uid: int, gid: int) -> None:
    etc = _mkdirs(root, "/etc")
    users = {0: "root", uid: "sandbox", 65534: "nobody"}
    with open(os.path.join(etc, "passwd"), "w") as f:
        f.writelines(f"{name}:x:{i}:{i if i != uid else gid}:{name}:/tmp:/usr/sbin/nologin\n"
                     for i, name in users.items())
    with open(os.path.join(etc, "group"), "w") as f:
        f.writelines(f"{name}:x:{i if i != uid else gid}:\n" for i, name in users.items())
    with open(os.path.join(etc, "hosts"), "w") as f:
        f.write("127.0.0.1 localhost\n::1 localhost\n")


def _mount_proc(target: str) -> None:
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    try:
        _mount("proc", target, "proc", flags, "subset=pid")  # only pid dirs (Linux 5.8+)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _mount("proc", target, "proc", flags)


def build_root(readonly_paths, disk_bytes: int, inodes: int, uid: int, gid: int,
               files: dict[str, bytes], staging: str = "/tmp") -> None:
    """Build the sandbox's root (see the module docstring) and pivot into it.

    Call in a fresh mount namespace, as the PID namespace's init (for ``/proc``), with
    CAP_SYS_ADMIN there. ``uid``/``gid`` own ``/tmp``; ``files`` are written into it.
    """
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we do here reaches the host
    sources = _open_sources(readonly_paths)
    _mount("sandbox-root", staging, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    tmp = _mkdirs(staging, "/tmp")  # first, so that bound paths under /tmp stay visible in it
    _mount("sandbox-tmp", tmp, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={disk_bytes},nr_inodes={inodes},mode=0700,uid={uid},gid={gid}")
    for path, source in sources:
        if isinstance(source, str):
            os.symlink(source, os.path.join(staging, path.lstrip("/")))
            continue
        target = os.path.join(staging, path.lstrip("/"))
        if os.path.isdir(f"/proc/self/fd/{source}"):
            _mkdirs(staging, path)
        else:
            _mkdirs(staging, os.path.dirname(path))
            open(target, "w").close()
        _bind_readonly(source, target)
        os.close(source)
    _populate_dev(staging)
    _mount_proc(_mkdirs(staging, "/proc"))
    _write_etc(staging, uid, gid)
    for name, data in files.items():
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, uid, gid)
    os.chdir(staging)
    _check(_libc.syscall(155 if _is_x86() else 41, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "umount2(old root)")
    os.chdir("/")
    _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir("/tmp")


def _is_x86() -> bool:
    return os.uname().machine == "x86_64"


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def drop_privileges(uid: int, gid: int, switch_uid: bool) -> None:
    """Leave no capability behind: empty bounding and ambient sets, securebits that stop
    uid 0 from regaining capabilities on exec, then (``switch_uid``: we are real root) the
    unprivileged ``uid``/``gid`` and, in every case, an explicit capset to nothing."""
    try:
        prctl(_PR_SET_SECUREBITS, _SECUREBITS_LOCKED_DOWN, "prctl(PR_SET_SECUREBITS)")
    except OSError:
        if not switch_uid:
            raise  # uid 0 inside a user namespace: the securebits are what keeps it powerless
    cap = 0
    while _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if ctypes.get_errno() != errno.EINVAL or cap < 32:
        raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap}) failed")
    prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    if switch_uid:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset(0)")


def effective_caps() -> int:
    """CapEff of this process (0 when every capability is gone)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return -1
