"""Seccomp filters of the code sandbox, built as classic BPF with ctypes (no libseccomp).

Why a deny-list and not an allow-list: the sandboxed program is a full CPython interpreter that
may import any stdlib module (and start ``/usr/bin`` tools), so the set of syscalls it needs
varies with the interpreter build, the libc version and the program; an allow-list breaks on the
next libc that adopts a new syscall. The sandbox's hard walls are the namespaces and the
unprivileged uid (``sandbox_kernel``); this filter removes the kernel interfaces that matter if
one of those walls has a hole or is missing (degraded mode): everything that mounts, changes
namespaces, traces or signals other processes, loads kernel code, or reaches past the network
namespace. Two rules make it safe against syscalls we never reviewed:

- the architecture is checked first (an i386 or x32 call from a 64-bit process is killed), so a
  program cannot switch syscall tables to dodge the numbers below;
- every syscall numbered above the newest one we reviewed (``_NEWEST_REVIEWED``) fails with
  ENOSYS, which libc and CPython treat as "kernel too old" and work around.

Two filters stack (seccomp keeps every filter installed, the strictest answer wins):
``base_filter`` for the harness and everything under it, ``program_filter`` added by the
program's process only (signals limited to its own processes; in degraded mode, where no
namespace backs them up, also no sockets and no new processes).

This module is imported by ``sandbox_boot`` inside the sandbox, so it uses the stdlib only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

# struct seccomp_data: nr (u32) @0, arch (u32) @4, instruction_pointer (u64) @8, args[6] (u64) @16
_NR, _ARCH = 0, 4
_LD_W_ABS, _JEQ, _JGE, _JGT, _JSET, _RET = 0x20, 0x15, 0x35, 0x25, 0x45, 0x06
_KILL_PROCESS, _ALLOW = 0x80000000, 0x7FFF0000
_X32_BIT = 0x40000000
_NEWEST_REVIEWED = 469  # file_setattr (Linux 6.17); numbers >= 403 are shared by all arches

# name: (x86_64, aarch64); None where the arch has no such syscall (always ENOSYS there)
_SYSCALLS = {
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "setns": (308, 268), "unshare": (272, 97), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "statmount": (457, 457), "listmount": (458, 458), "open_tree_attr": (467, 467),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "pidfd_open": (434, 434), "pidfd_send_signal": (424, 424),
    "pidfd_getfd": (438, 438), "process_madvise": (440, 440), "process_mrelease": (448, 448),
    "bpf": (321, 280), "perf_event_open": (298, 241), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "acct": (163, 89), "syslog": (103, 116), "quotactl": (179, 60),
    "quotactl_fd": (443, 443), "lookup_dcookie": (212, 18), "nfsservctl": (180, 42),
    "uselib": (134, None), "ustat": (136, None), "sysfs": (139, None), "_sysctl": (156, None),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None),
    "vhangup": (153, 58), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171), "sethostname": (170, 161),
    "setdomainname": (171, 162), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "userfaultfd": (323, 282), "fanotify_init": (300, 262),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "mbind": (237, 235), "set_mempolicy": (238, 237), "migrate_pages": (256, 238),
    "move_pages": (279, 239), "set_mempolicy_home_node": (450, 450),
    "lsm_set_self_attr": (460, 460), "create_module": (174, None),
    "get_kernel_syms": (177, None), "query_module": (178, None),
    "clone3": (435, 435), "clone": (56, 220), "kill": (62, 129), "tkill": (200, 130),
    "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240),
    "setsid": (112, 157), "setpgid": (109, 154), "fork": (57, None), "vfork": (58, None), "socket": (41, 198), "ioctl": (16, 29),
    "personality": (135, 92), "prlimit64": (302, 261), "setpriority": (141, 140),
    "ioprio_set": (251, 30), "sched_setaffinity": (203, 122), "sched_setscheduler": (144, 119),
    "sched_setparam": (142, 118), "sched_setattr": (314, 274),
}
_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column, AUDIT_ARCH_*

# Denied outright (EPERM): namespaces and mounts, tracing and reaching into other processes,
# kernel modules / kexec / reboot / swap / accounting / clocks / keyrings / BPF / perf,
# io_uring (its operations bypass seccomp), file handles (the classic container escape),
# NUMA policy and the LSM attribute setter.
DENIED = (
    "mount", "umount2", "pivot_root", "chroot", "setns", "unshare", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "statmount", "listmount",
    "open_tree_attr", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open",
    "pidfd_send_signal", "pidfd_getfd", "process_madvise", "process_mrelease", "bpf",
    "perf_event_open", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "syslog", "quotactl",
    "quotactl_fd", "lookup_dcookie", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl",
    "iopl", "ioperm", "modify_ldt", "vhangup", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "sethostname", "setdomainname", "keyctl", "add_key", "request_key",
    "userfaultfd", "fanotify_init", "open_by_handle_at", "name_to_handle_at", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "mbind", "set_mempolicy", "migrate_pages",
    "move_pages", "set_mempolicy_home_node", "lsm_set_self_attr", "create_module",
    "get_kernel_syms", "query_module",
)
_CLONE_NAMESPACES = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_CLONE_THREAD = 0x00010000
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C  # push input into / control a terminal
_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK (all per-netns)
_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # LINUX, LINUX32, UNAME26, both, query
_SELF_ONLY = (("prlimit64", 0), ("setpriority", 1), ("ioprio_set", 1), ("sched_setaffinity", 0),
              ("sched_setscheduler", 0), ("sched_setparam", 0), ("sched_setattr", 0))


class SeccompUnavailable(OSError):
    """This machine's architecture has no syscall table here, or the kernel refused the filter."""


def _errno(code: int) -> int:
    return 0x00050000 | code


class _Program:
    """A tiny BPF assembler: blocks with local labels, jumps resolved to 8-bit offsets."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, int]] = []  # (op, jt, jf, k)
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int = 0, jt: object = 0, jf: object = 0) -> None:
        self.code.append((code, jt, jf, k & 0xFFFFFFFF))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = []
        for i, (code, jt, jf, k) in enumerate(self.code):
            offs = [self.labels[t] - i - 1 if isinstance(t, str) else t for t in (jt, jf)]
            assert all(0 <= o <= 255 for o in offs), (i, offs)
            out.append(struct.pack("=HBBI", code, offs[0], offs[1], k))
        return b"".join(out)


def _arg(i: int) -> int:
    """Offset of the low 32 bits of syscall argument ``i`` (what the kernel uses for an int)."""
    return 16 + 8 * i + (0 if struct.pack("=I", 1)[0] == 1 else 4)


def _allow_values(p: _Program, tag: str, nr: int, arg: int, values, deny: int,
                  ranges=()) -> None:
    """If syscall ``nr``: allow when the arg's low 32 bits are in ``values`` or a
    [lo, hi] range of ``ranges``, else return ``deny``."""
    p.op(_JEQ, nr, 0, f"{tag}_skip")
    p.op(_LD_W_ABS, _arg(arg))
    for v in values:
        p.op(_JEQ, v, f"{tag}_ok", 0)
    for n, (lo, hi) in enumerate(ranges):
        p.op(_JGE, lo, 0, f"{tag}_r{n}")
        p.op(_JGT, hi, f"{tag}_r{n}", f"{tag}_ok")
        p.label(f"{tag}_r{n}")
    p.op(_RET, deny)
    p.label(f"{tag}_ok")
    p.op(_RET, _ALLOW)
    p.label(f"{tag}_skip")
    p.op(_LD_W_ABS, _NR)  # the accumulator holds the syscall number again


def _deny_values(p: _Program, tag: str, nr: int, arg: int, values, deny: int,
                 mask: int = 0) -> None:
    """If syscall ``nr``: return ``deny`` when the arg equals one of ``values`` (or has a bit
    of ``mask``), else allow."""
    p.op(_JEQ, nr, 0, f"{tag}_skip")
    p.op(_LD_W_ABS, _arg(arg))
    for v in values:
        p.op(_JEQ, v, f"{tag}_no", 0)
    if mask:
        p.op(_JSET, mask, f"{tag}_no", 0)
    p.op(_RET, _ALLOW)
    p.label(f"{tag}_no")
    p.op(_RET, deny)
    p.label(f"{tag}_skip")
    p.op(_LD_W_ABS, _NR)


def _arch() -> tuple[int, int]:
    machine = os.uname().machine
    if machine not in _ARCHES:
        raise SeccompUnavailable(f"no syscall table for {machine!r} (have {sorted(_ARCHES)})")
    return _ARCHES[machine]


def _prologue(p: _Program, audit_arch: int, x86: bool) -> None:
    p.op(_LD_W_ABS, _ARCH)
    p.op(_JEQ, audit_arch, 1, 0)
    p.op(_RET, _KILL_PROCESS)
    p.op(_LD_W_ABS, _NR)
    if x86:
        p.op(_JGE, _X32_BIT, 0, 1)
        p.op(_RET, _KILL_PROCESS)
    p.op(_JGT, _NEWEST_REVIEWED, 0, 1)
    p.op(_RET, _errno(errno.ENOSYS))


def base_filter(degraded: bool) -> bytes:
    """The filter every sandbox process gets: see the module docstring."""
    col, audit_arch = _arch()
    nr = {name: nums[col] for name, nums in _SYSCALLS.items() if nums[col] is not None}
    p = _Program()
    _prologue(p, audit_arch, col == 0)
    for name in DENIED:
        if name in nr:
            p.op(_JEQ, nr[name], 0, 1)
            p.op(_RET, _errno(errno.EPERM))
    p.op(_JEQ, nr["clone3"], 0, 1)  # flags live in memory seccomp cannot read: make libc
    p.op(_RET, _errno(errno.ENOSYS))  # fall back to clone(), whose flags it can
    _deny_values(p, "clone", nr["clone"], 0, (), _errno(errno.EPERM), mask=_CLONE_NAMESPACES)
    _deny_values(p, "ioctl", nr["ioctl"], 1, (_TIOCSTI, _TIOCLINUX), _errno(errno.EPERM))
    _allow_values(p, "pers", nr["personality"], 0, _PERSONALITIES, _errno(errno.EPERM))
    for name, arg in _SELF_ONLY:  # only the calling process itself (0), never another pid
        _allow_values(p, name, nr[name], arg, (0,), _errno(errno.EPERM))
    if degraded:  # no network namespace: no sockets at all (socketpair still works)
        p.op(_JEQ, nr["socket"], 0, 1)
        p.op(_RET, _errno(errno.EACCES))
    else:
        _allow_values(p, "sock", nr["socket"], 0, _SOCKET_FAMILIES, _errno(errno.EAFNOSUPPORT))
    p.op(_RET, _ALLOW)
    return p.assemble()


def program_filter(own_pid: int, degraded: bool) -> bytes:
    """Extra filter of the program's process (and its children): signals reach only its own
    processes. ``own_pid`` is the program's pid (its process group after ``setsid``).

    With a PID namespace, pid 1 is the harness (the namespace's init) and every other pid is
    the program's, so any pid >= 2, 0 (own group) and -own_pid are allowed. Without one
    (degraded), there is nothing to catch a process that outlives its parent, so the program
    may not create processes at all (threads only: clone needs CLONE_THREAD; fork and vfork
    are refused) and may signal only itself (0, -own_pid, own_pid).
    """
    col, audit_arch = _arch()
    nr = {name: nums[col] for name, nums in _SYSCALLS.items() if nums[col] is not None}
    p = _Program()
    _prologue(p, audit_arch, col == 0)
    group = -own_pid & 0xFFFFFFFF
    pids = (0, group) if not degraded else (0, group, own_pid)
    others = () if degraded else ((2, 0x7FFFFFFF),)
    for name in ("kill", "tkill", "rt_sigqueueinfo"):
        _allow_values(p, name, nr[name], 0, pids, _errno(errno.EPERM), others)
    tgids = (own_pid,) if degraded else ()
    for name in ("tgkill", "rt_tgsigqueueinfo"):
        _allow_values(p, name, nr[name], 0, tgids, _errno(errno.EPERM), others)
    if degraded:
        for name in ("fork", "vfork", "setsid", "setpgid"):
            if name in nr:
                p.op(_JEQ, nr[name], 0, 1)
                p.op(_RET, _errno(errno.EPERM))
        p.op(_JEQ, nr["clone"], 0, 4)
        p.op(_LD_W_ABS, _arg(0))
        p.op(_JSET, _CLONE_THREAD, 1, 0)
        p.op(_RET, _errno(errno.EPERM))
        p.op(_RET, _ALLOW)
    p.op(_RET, _ALLOW)
    return p.assemble()


_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(program: bytes) -> None:
    """Set no_new_privs and load ``program`` as a seccomp filter on the calling thread
    (call it before starting any thread). Raises SeccompUnavailable when refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise SeccompUnavailable(f"prctl(PR_SET_NO_NEW_PRIVS): {errno.errorcode[ctypes.get_errno()]}")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise SeccompUnavailable(f"prctl(PR_SET_SECCOMP): {errno.errorcode[ctypes.get_errno()]}")
