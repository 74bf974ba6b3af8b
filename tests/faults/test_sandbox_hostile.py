"""Hostile programs against the code sandbox: each one tries to hurt the host or fake a reward.

Every test runs a real program in the real sandbox and checks the host side: the canary file
is unchanged, the listener got no connection, the victim process and this worker live, no
process of the run survives it, and the reward is right (0 for a wrong solution, 1 for a correct
one). Host files the program should see but not touch are exposed read-only through
``readonly_paths``; ``victim`` stands for the rollout worker's other processes.

One file on purpose (~740 lines): it is the catalogue of attacks that docs/reliability.md renders,
in this order (walls, limits, reward cheats, dying workers), and every test shares the same host
fixtures (canary, listener, victim) defined below; split, each part would re-import them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_darl.rewards.code_exec import humaneval_reward_with, stdio_reward_with
from megatron_darl.rewards.config import CodeRewardConfig
from megatron_darl.rewards.sandbox import SandboxConfig, run_sandboxed
from megatron_darl.rewards.sandbox_seccomp import _ARCHES, _SYSCALLS

COL = _ARCHES.get(os.uname().machine, (0, 0))[0]
NR = {name: nums[COL] for name, nums in _SYSCALLS.items() if nums[COL] is not None}

PRELUDE = """
import ctypes, errno, os, signal, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def attempt(name, fn):
    try:
        print(f"{name}: ESCAPED {fn()!r}", flush=True)
    except OSError as exc:
        print(f"{name}: refused {errno.errorcode.get(exc.errno, exc.errno)}", flush=True)
    except Exception as exc:
        print(f"{name}: refused {type(exc).__name__}", flush=True)
def sys_call(nr, *args):
    ret = libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if ret == -1:
        raise OSError(ctypes.get_errno(), "")
    return ret
"""


def _outcomes(result) -> dict[str, str]:
    out = {}
    for line in result.stdout.splitlines():
        if ": " in line:
            name, _, verdict = line.partition(": ")
            out[name] = verdict
    return out


def _assert_all_refused(result, names) -> dict[str, str]:
    outcomes = _outcomes(result)
    assert set(names) <= set(outcomes), (result.stdout, result.stderr)
    escaped = {n: v for n, v in outcomes.items() if v.startswith("ESCAPED")}
    assert not escaped, escaped
    return outcomes


def _survivors(result, wait: float = 3.0) -> list[str]:
    """Processes of this run still alive after ``wait`` s: its host uid (one of its own when we
    are root) or a boot process started by this worker."""
    me, end = str(os.getpid()), time.monotonic() + wait
    while True:
        alive = []
        for p in psutil.process_iter(["uids", "cmdline", "status", "pid"]):
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd, uids = p.info["cmdline"] or [], p.info["uids"]
            own_uid = result.uid not in (-1, os.getuid()) and uids and uids.real == result.uid
            if own_uid or (cmd[-1:] == [me] and any("sandbox_boot" in c for c in cmd)):
                alive.append(f"{p.info['pid']} {' '.join(cmd)[:80]}")
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.1)


@pytest.fixture
def host(tmp_path):
    """A host directory the sandbox sees read-only: a canary (0644) and a secret (0600)."""
    d = tmp_path / "host"
    d.mkdir()
    (d / "canary.txt").write_text("original")
    (d / "secret.txt").write_text(f"secret-{uuid.uuid4().hex}")
    (d / "secret.txt").chmod(0o600)
    d.chmod(0o755)
    tmp_path.chmod(0o755)
    return d


def _cfg(host: Path | None = None, **kw) -> SandboxConfig:
    kw.setdefault("wall_seconds", 5.0)
    kw.setdefault("cpu_seconds", 4)
    paths = SandboxConfig().readonly_paths + ((str(host),) if host else ())
    return SandboxConfig(readonly_paths=paths, **kw)


def _host_untouched(host: Path) -> None:
    assert (host / "canary.txt").read_text() == "original"
    assert sorted(p.name for p in host.iterdir()) == ["canary.txt", "secret.txt"]
    assert oct((host / "canary.txt").stat().st_mode)[-3:] == "644"


@pytest.fixture
def victim():
    """A host process of the worker's (root) that the program must not be able to signal."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc.pid
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def listener():
    """A TCP listener on every host address and an abstract unix socket, both of this host."""
    tcp = socket.socket()
    tcp.bind(("0.0.0.0", 0))
    tcp.listen(16)
    tcp.setblocking(False)
    unix = socket.socket(socket.AF_UNIX)
    name = f"darl-hostile-{uuid.uuid4().hex}"
    unix.bind("\0" + name)
    unix.listen(16)
    unix.setblocking(False)
    addrs = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                    if a.family == socket.AF_INET})
    yield tcp.getsockname()[1], name, addrs
    for s in (tcp, unix):
        with pytest.raises(BlockingIOError):
            s.accept()  # nobody connected
        s.close()


@pytest.mark.fault(kind="hostile code", name="remount / read-write (ctypes mount)")
def test_remount_and_write_host_files_is_refused(host):
    """mount(MS_REMOUNT) of / and of a read-only host dir fails; the host canary is unchanged."""
    code = PRELUDE + textwrap.dedent(f"""
        for target in (b"/", {str(host).encode()!r}):
            attempt(f"remount {{target}}", lambda: sys_call({NR['mount']}, None, target, None,
                                                            32 | 4096, None))
        attempt("mount tmpfs", lambda: sys_call({NR['mount']}, b"x", {str(host).encode()!r},
                                                b"tmpfs", 0, None))
        attempt("write canary", lambda: open({str(host / 'canary.txt')!r}, "w").write("owned"))
        attempt("umount", lambda: sys_call({NR['umount2']}, {str(host).encode()!r}, 2))
    """)
    result = run_sandboxed(code, "", _cfg(host))
    out = _assert_all_refused(result, ["remount b'/'", "mount tmpfs", "write canary", "umount"])
    assert out["write canary"] == "refused EROFS"
    _host_untouched(host)


@pytest.mark.fault(kind="hostile code", name="write outside the sandbox directory")
def test_writes_outside_are_refused(host):
    """open/os.open/pathlib/shutil/rename/link/chmod on host paths fail; host dir unchanged."""
    c, h = str(host / "canary.txt"), str(host)
    code = PRELUDE + textwrap.dedent(f"""
        import pathlib, shutil
        attempt("open", lambda: open({c!r}, "a").write("x"))
        attempt("os.open", lambda: os.open({h!r} + "/new", os.O_WRONLY | os.O_CREAT))
        attempt("pathlib", lambda: pathlib.Path({h!r}, "p").write_text("x"))
        open("local", "w").write("x")
        attempt("shutil.copy", lambda: shutil.copy("local", {h!r}))
        attempt("rename", lambda: os.rename("local", {h!r} + "/moved"))
        attempt("hardlink", lambda: os.link({c!r}, "link"))
        attempt("chmod", lambda: os.chmod({c!r}, 0o777))
        attempt("unlink", lambda: os.unlink({c!r}))
        attempt("truncate", lambda: os.truncate({c!r}, 0))
        attempt("write /usr", lambda: open("/usr/owned", "w"))
        attempt("write /etc", lambda: open("/etc/owned", "w"))
    """)
    result = run_sandboxed(code, "", _cfg(host))
    _assert_all_refused(result, ["open", "os.open", "pathlib", "shutil.copy", "rename",
                                 "hardlink", "chmod", "unlink", "truncate", "write /usr"])
    _host_untouched(host)


@pytest.mark.fault(kind="hostile code", name="dir_fd tricks")
def test_dir_fd_tricks_are_refused(host):
    """os calls relative to a directory fd of a host dir (dir_fd=, O_PATH, openat) all fail."""
    h = str(host)
    code = PRELUDE + textwrap.dedent(f"""
        d = os.open({h!r}, os.O_RDONLY | os.O_DIRECTORY)
        p = os.open({h!r}, os.O_PATH)
        attempt("open dir_fd", lambda: os.open("new", os.O_WRONLY | os.O_CREAT, dir_fd=d))
        attempt("open canary dir_fd", lambda: os.open("canary.txt", os.O_WRONLY, dir_fd=d))
        attempt("mkdir dir_fd", lambda: os.mkdir("sub", dir_fd=d))
        attempt("unlink dir_fd", lambda: os.unlink("canary.txt", dir_fd=d))
        attempt("symlink dir_fd", lambda: os.symlink("/tmp", "ln", dir_fd=d))
        attempt("rename dir_fds", lambda: os.rename("canary.txt", "c2", src_dir_fd=d, dst_dir_fd=d))
        attempt("O_PATH reopen", lambda: open(f"/proc/self/fd/{{p}}/canary.txt", "w"))
        attempt("chmod dir_fd", lambda: os.chmod("canary.txt", 0o777, dir_fd=d))
        attempt("utime dir_fd", lambda: os.utime("canary.txt", (0, 0), dir_fd=d))
    """)
    result = run_sandboxed(code, "", _cfg(host))
    _assert_all_refused(result, ["open dir_fd", "open canary dir_fd", "mkdir dir_fd",
                                 "unlink dir_fd", "symlink dir_fd", "rename dir_fds",
                                 "O_PATH reopen", "chmod dir_fd", "utime dir_fd"])
    _host_untouched(host)
    assert (host / "canary.txt").stat().st_mtime > 0


@pytest.mark.fault(kind="hostile code", name="read /etc/shadow and host secrets")
def test_host_secrets_are_not_readable(host, monkeypatch):
    """/etc/shadow, a 0600 host file, /root, the worker's /proc and environment stay unread."""
    secret = (host / "secret.txt").read_text()
    monkeypatch.setenv("DARL_TEST_SECRET", secret)
    code = PRELUDE + textwrap.dedent(f"""
        attempt("shadow", lambda: open("/etc/shadow").read())
        attempt("secret file", lambda: open({str(host / 'secret.txt')!r}).read())
        attempt("root home", lambda: os.listdir("/root/.ssh"))
        attempt("worker environ", lambda: open("/proc/{os.getpid()}/environ", "rb").read())
        attempt("harness environ", lambda: open("/proc/1/environ", "rb").read())
        attempt("harness fds", lambda: os.listdir("/proc/1/fd"))
        attempt("harness memory", lambda: open("/proc/1/mem", "rb").read(1))
        attempt("harness root", lambda: os.listdir("/proc/1/root/"))
        attempt("env", lambda: os.environ["DARL_TEST_SECRET"])
        attempt("work tree", lambda: os.listdir({str(Path(__file__).parent)!r}))
        attempt("block device", lambda: open("/dev/vda", "rb").read(512))
        attempt("kernel log", lambda: open("/dev/kmsg", "rb").read(1))
    """)
    result = run_sandboxed(code, "", _cfg(host))
    out = _assert_all_refused(result, ["shadow", "secret file", "root home", "worker environ",
                                       "harness environ", "harness fds", "harness memory",
                                       "harness root", "env", "work tree"])
    assert out["secret file"] == "refused EACCES"  # visible, but the uid is not root
    assert secret not in result.stdout + result.stderr


@pytest.mark.fault(kind="hostile code", name="network connect to a local listener")
def test_network_connect_to_host_listener_fails(listener):
    """TCP to every host address and to a host abstract unix socket gets no connection."""
    port, unix_name, addrs = listener
    code = PRELUDE + textwrap.dedent(f"""
        for addr in {addrs!r}:
            attempt(f"tcp {{addr}}", lambda: socket.create_connection((addr, {port}), timeout=1))
        def unix():
            s = socket.socket(socket.AF_UNIX)
            s.connect("\\0" + {unix_name!r})
        attempt("abstract unix", unix)
        attempt("vsock", lambda: socket.socket(40, socket.SOCK_STREAM))
        attempt("packet", lambda: socket.socket(17, socket.SOCK_RAW))
        print("interfaces:", sorted(n for _, n in socket.if_nameindex()))
    """)
    result = run_sandboxed(code, "", _cfg())
    _assert_all_refused(result, [f"tcp {a}" for a in addrs] + ["abstract unix", "vsock", "packet"])
    assert "interfaces: ['lo']" in result.stdout


@pytest.mark.fault(kind="hostile code", name="join the host netns (setns, unshare)")
def test_setns_and_unshare_cannot_reach_the_host_network(listener):
    """setns on every visible netns and unshare of new namespaces fail; no connection made."""
    port, _, _ = listener
    code = PRELUDE + textwrap.dedent(f"""
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                def join(pid=pid):
                    fd = os.open(f"/proc/{{pid}}/ns/net", os.O_RDONLY)
                    return sys_call({NR['setns']}, fd, 0x40000000)
                attempt(f"setns {{pid}}", join)
        attempt("unshare user+net", lambda: sys_call({NR['unshare']}, 0x10000000 | 0x40000000))
        attempt("clone newuser", lambda: sys_call({NR['clone']}, 0x10000000 | 17, 0, 0, 0, 0))
        attempt("clone3", lambda: sys_call({NR['clone3']}, 0, 0))
        attempt("tcp after", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1))
    """)
    result = run_sandboxed(code, "", _cfg())
    out = _assert_all_refused(result, ["setns 1", "setns 2", "unshare user+net",
                                       "clone newuser", "clone3", "tcp after"])
    assert out["unshare user+net"] == out["clone newuser"] == "refused EPERM"
    assert out["clone3"] == "refused ENOSYS"


@pytest.mark.fault(kind="hostile code", name="setsid daemon that outlives the run")
def test_setsid_daemon_dies_with_the_run():
    """A double-forked setsid daemon is killed when the program exits; the run ends at once."""
    code = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.closerange(0, 64)
                while True:
                    time.sleep(0.05)
            os._exit(0)
        time.sleep(0.3)
        print("parent done")
    """)
    start = time.monotonic()
    result = run_sandboxed(code, "", _cfg(wall_seconds=20.0))
    assert result.ok and result.stdout == "parent done\n", result
    assert time.monotonic() - start < 10.0  # not the 20 s wall clock
    assert _survivors(result, wait=0.0) == []


@pytest.mark.fault(kind="hostile code", name="kill the worker or harness (kill, pidfd)")
def test_signals_cannot_reach_worker_or_harness(victim):
    """kill/killpg/tgkill/pidfd on the worker, a worker-owned process and the harness fail."""
    worker = os.getpid()
    code = PRELUDE + textwrap.dedent(f"""
        for name, pid in (("victim", {victim}), ("worker", {worker}), ("harness", 1)):
            attempt(f"kill {{name}}", lambda: os.kill(pid, signal.SIGKILL))
            attempt(f"killpg {{name}}", lambda: os.killpg(pid, signal.SIGKILL))
            attempt(f"tgkill {{name}}", lambda: sys_call({NR['tgkill']}, pid, pid, 9))
            attempt(f"pidfd {{name}}", lambda: signal.pidfd_send_signal(os.pidfd_open(pid), 9))
        attempt("kill -1", lambda: os.kill(-1, signal.SIGKILL))
        attempt("prlimit harness", lambda: sys_call({NR['prlimit64']}, 1, 0, 0, 0))
        attempt("ptrace harness", lambda: sys_call({NR['ptrace']}, 16, 1, 0, 0))
        attempt("process_vm_readv", lambda: sys_call({NR['process_vm_readv']}, 1, 0, 0, 0, 0, 0))
        print("still here")
    """)
    result = run_sandboxed(code, "", _cfg())
    names = [f"{k} {n}" for n in ("victim", "worker", "harness") for k in ("kill", "killpg", "tgkill", "pidfd")]
    _assert_all_refused(result, names + ["kill -1", "prlimit harness", "ptrace harness"])
    assert "still here" in result.stdout and result.ok
    assert psutil.pid_exists(victim) and psutil.Process(victim).status() != psutil.STATUS_ZOMBIE


@pytest.mark.fault(kind="hostile code", name="dangerous syscalls through ctypes")
def test_dangerous_syscalls_are_refused_by_seccomp():
    """Each denied syscall returns EPERM (ENOSYS for clone3) from the filter, whatever its args."""
    names = ["mount", "umount2", "pivot_root", "chroot", "setns", "unshare", "ptrace", "bpf",
             "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module",
             "kexec_load", "reboot", "swapon", "swapoff", "perf_event_open", "io_uring_setup",
             "userfaultfd", "open_by_handle_at", "name_to_handle_at", "process_vm_writev",
             "pidfd_open", "pidfd_getfd", "fsopen", "open_tree", "move_mount", "acct",
             "settimeofday", "sethostname", "syslog", "fanotify_init", "kcmp"]
    code = PRELUDE + "".join(f"attempt({n!r}, lambda: sys_call({NR[n]}, 0, 0, 0, 0, 0))\n"
                             for n in names if n in NR)
    code += f"attempt('ioctl TIOCSTI', lambda: sys_call({NR['ioctl']}, 0, 0x5412, 0))\n"
    code += f"attempt('personality', lambda: sys_call({NR['personality']}, 0x0040000))\n"
    code += "attempt('beyond reviewed', lambda: sys_call(1000, 0))\n"
    result = run_sandboxed(code, "", _cfg())
    out = _assert_all_refused(result, [n for n in names if n in NR] + ["ioctl TIOCSTI"])
    wrong = {n: v for n, v in out.items() if v != "refused EPERM" and n != "beyond reviewed"}
    assert not wrong, wrong
    assert out["beyond reviewed"] == "refused ENOSYS"


@pytest.mark.fault(kind="hostile code", name="run as root or keep capabilities")
def test_program_has_no_privileges():
    """The program's uid is not root on the host, every capability set is empty, no_new_privs
    and two seccomp filters are on."""
    code = "print(open('/proc/self/status').read())"
    result = run_sandboxed(code, "", _cfg())
    status = dict(line.split(":", 1) for line in result.stdout.splitlines() if ":" in line)
    uids = status["Uid"].split()
    assert result.uid > 0 and all(int(u) == result.uid for u in uids)
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[key], 16) == 0, key
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp_filters"].strip() == "2"


@pytest.mark.fault(kind="hostile code", name="setuid binaries")
def test_setuid_binaries_grant_nothing():
    """The setuid-root mount and su are visible but run without privileges (no_new_privs,
    nosuid mounts): mounting fails and the tmpfs mount table is unchanged."""
    code = textwrap.dedent("""
        import os, subprocess
        os.mkdir("m")
        before = open("/proc/self/mounts").read()
        for argv in (["mount", "-t", "tmpfs", "none", "/tmp/m"], ["su", "-c", "id -u"]):
            out = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            print(argv[0], out.returncode != 0, out.stdout.strip() or "-")
        print("mounts unchanged", open("/proc/self/mounts").read() == before)
        print("setuid bit visible", bool(os.stat("/usr/bin/mount").st_mode & 0o4000))
    """)
    if not Path("/usr/bin/mount").is_file() or not Path("/usr/bin/su").is_file():
        pytest.skip("needs the setuid-root /usr/bin/mount and /usr/bin/su")
    result = run_sandboxed(code, "", _cfg())
    assert result.stdout.splitlines() == ["mount True -", "su True -", "mounts unchanged True",
                                          "setuid bit visible True"], (result.stdout, result.stderr)


@pytest.mark.fault(kind="hostile code", name="subinterpreter bypass")
def test_subinterpreter_gets_no_more_than_the_program(host, victim, listener):
    """Code run in a subinterpreter (which once skipped the audit-hook guard) can neither write
    host files, signal the victim nor connect out."""
    port, _, _ = listener
    inner = textwrap.dedent(f"""
        import os, signal, socket
        for name, fn in (("write", lambda: open({str(host / 'canary.txt')!r}, "w").write("x")),
                         ("kill", lambda: os.kill({victim}, signal.SIGKILL)),
                         ("connect", lambda: socket.create_connection(("127.0.0.1", {port}), 1))):
            try:
                fn()
                print(name + ": ESCAPED", flush=True)
            except Exception as exc:
                print(name + ": refused " + type(exc).__name__, flush=True)
    """)
    code = f"import _xxsubinterpreters as si\nsi.run_string(si.create(), {inner!r})\n"
    result = run_sandboxed(code, "", _cfg(host))
    _assert_all_refused(result, ["write", "kill", "connect"])
    _host_untouched(host)
    assert psutil.Process(victim).status() != psutil.STATUS_ZOMBIE


@pytest.mark.fault(kind="hostile code", name="fork bomb")
def test_fork_bomb_is_bounded_and_reaped():
    """Forks stop at RLIMIT_NPROC (the harness counts as one), the run ends, nothing survives."""
    code = textwrap.dedent("""
        import os, time
        children = 0
        while True:
            try:
                if os.fork() == 0:
                    while True:
                        time.sleep(1)
                children += 1
            except OSError:
                break
        print(children)
    """)
    result = run_sandboxed(code, "", _cfg(max_processes=16))
    assert result.ok, result
    assert 0 < int(result.stdout) <= 16 - 2  # the harness and the program itself count
    assert _survivors(result, wait=0.0) == []
    probe = subprocess.run(["true"], timeout=10)  # the worker can still fork
    assert probe.returncode == 0


@pytest.mark.fault(kind="hostile code", name="memory bomb")
def test_memory_bomb_fails_inside_the_sandbox():
    """A huge allocation and a growing list both hit RLIMIT_AS in the program, not the worker."""
    before = psutil.Process().memory_info().rss
    code = textwrap.dedent("""
        try:
            x = bytearray(8 << 30)
        except MemoryError:
            print("big refused")
        chunks = []
        while True:
            chunks.append(bytearray(64 << 20))
    """)
    result = run_sandboxed(code, "", _cfg(memory_bytes=512 << 20))
    assert not result.ok and "big refused" in result.stdout
    assert "MemoryError" in result.stderr
    assert psutil.Process().memory_info().rss - before < 64 << 20


@pytest.mark.fault(kind="hostile code", name="disk filler")
def test_disk_filler_stops_at_the_tmpfs_size():
    """Writing many files stops at disk_bytes in total (ENOSPC), each file at file_size_bytes."""
    code = textwrap.dedent("""
        import errno
        total = 0
        try:
            for i in range(1000):
                with open(f"f{i}", "wb") as f:
                    for _ in range(8):
                        f.write(b"x" * (1 << 20))
                        f.flush()
                        total += 1 << 20
        except OSError as exc:
            print(errno.errorcode[exc.errno], total)
    """)
    cfg = _cfg(disk_bytes=24 << 20, file_size_bytes=64 << 20)
    result = run_sandboxed(code, "", cfg)
    err, total = result.stdout.split()
    assert err == "ENOSPC" and int(total) <= 24 << 20
    big = run_sandboxed("open('f', 'wb').write(b'x' * (4 << 20))", "", _cfg(file_size_bytes=1 << 20))
    assert not big.ok  # SIGXFSZ is ignored by Python: the write fails with EFBIG


@pytest.mark.fault(kind="hostile code", name="inode filler")
def test_inode_filler_stops_at_the_inode_cap():
    """Creating empty files stops at disk_inodes with ENOSPC."""
    code = textwrap.dedent("""
        import errno, os
        n = 0
        try:
            while True:
                os.mkdir(f"d{n}")
                n += 1
        except OSError as exc:
            print(errno.errorcode[exc.errno], n)
    """)
    result = run_sandboxed(code, "", _cfg(disk_inodes=500))
    err, n = result.stdout.split()
    assert err == "ENOSPC" and int(n) < 500


@pytest.mark.fault(kind="hostile code", name="huge output")
def test_huge_output_is_capped_and_the_run_killed():
    """Past max_output_bytes the run is killed; the worker holds at most the cap."""
    start = time.monotonic()
    result = run_sandboxed("while True:\n    print('x' * 10000)\n", "",
                           _cfg(max_output_bytes=64 << 10, wall_seconds=20.0))
    assert result.output_truncated and not result.ok
    assert len(result.stdout) <= 64 << 10
    assert time.monotonic() - start < 10.0
    assert _survivors(result) == []


@pytest.mark.fault(kind="hostile code", name="sleep forever")
def test_sleeping_forever_is_killed_at_the_wall_clock():
    """A program (and a child) sleeping forever is killed at wall_seconds; nothing survives."""
    code = "import os, time\nos.fork()\ntime.sleep(3600)\n"
    start = time.monotonic()
    result = run_sandboxed(code, "", _cfg(wall_seconds=1.5))
    assert result.timed_out and not result.ok
    assert time.monotonic() - start < 5.0
    assert _survivors(result, wait=0.0) == []


@pytest.mark.fault(kind="hostile code", name="ignore every signal")
def test_signal_ignoring_program_is_still_killed():
    """Ignoring or blocking every catchable signal does not outlive the wall clock."""
    code = textwrap.dedent("""
        import signal, time
        for s in signal.valid_signals():
            try:
                signal.signal(s, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        while True:
            time.sleep(0.01)
    """)
    result = run_sandboxed(code, "", _cfg(wall_seconds=1.5))
    assert result.timed_out
    assert _survivors(result, wait=0.0) == []


@pytest.mark.fault(kind="hostile code", name="busy loop")
def test_busy_loop_hits_the_cpu_limit():
    """A spinning program is stopped by RLIMIT_CPU before the wall clock."""
    result = run_sandboxed("while True:\n    pass\n", "", _cfg(cpu_seconds=1, wall_seconds=30.0))
    assert not result.ok and not result.timed_out
    assert result.returncode in (-signal.SIGXCPU, -signal.SIGKILL)


NONCE = uuid.uuid4().hex
PROBLEM = {
    "task_id": "hostile/add",
    "prompt": "def add(a: int, b: int) -> int:\n    \"\"\"Return a + b.\"\"\"\n",
    "test": f"# {NONCE}\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"
            "    assert candidate(-4, 4) == 0\n    assert candidate(10, 5) == 15\n",
    "entry_point": "add",
}
RIGHT, WRONG = "    return a + b\n", "    return 0\n"
CHEATS = {  # appended to a wrong body; each tries to make the check look passed
    "sys.exit(0)": "import sys\nsys.exit(0)\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "raise SystemExit": "raise SystemExit\n",
    "exit(0) builtin": "exit(0)\n",
    "atexit hook": "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "exit inside the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "SystemExit inside the call": "def add(a, b):\n    raise SystemExit(0)\n",
    "fake verdict output": "print('passed\\nALL TESTS PASSED\\n{\"passed\": true}')\n"
                           "import sys\nsys.stderr.write('OK\\n')\n",
    "close every fd": "import os\nos.closerange(0, 1024)\nos._exit(0)\n",
    "kill own group": "import os, signal\nos.killpg(0, signal.SIGKILL)\n",
    "SIGKILL itself": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "thread exits later": "import os, threading, time\n"
                          "threading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()\n",
    "always-equal result": "class Eq(int):\n    def __eq__(self, o):\n        return True\n"
                           "def add(a, b):\n    return Eq(0)\n",
    "patched builtins": "import builtins\nbuiltins.AssertionError = type('X', (BaseException,), {})\n",
    "redefined check": "def check(candidate):\n    pass\nimport sys\nsys.exit(0)\n",
    "write to every fd": "import os\nfor fd in range(3, 64):\n    try:\n"
                         "        os.write(fd, b'{\"event\": \"done\", \"passed\": true}\\n')\n"
                         "    except OSError:\n        pass\n",
    "hang the harness": "import time\ndef add(a, b):\n    time.sleep(3600)\n",
    "kill the harness": "import os, signal\nfor s in (9, 15, 2, 14):\n    try:\n"
                        "        os.kill(1, s)\n    except OSError:\n        pass\n",
}


@pytest.mark.parametrize("cheat", [
    pytest.param(c, id=c, marks=pytest.mark.fault(kind="hostile code", name=f"early exit: {c}"))
    for c in CHEATS])
def test_humaneval_cheats_score_zero(cheat):
    """A wrong HumanEval solution with the cheat scores 0; the same cheat cannot fail a correct
    solution's harness either (the verdict is the harness's, not the exit code)."""
    cfg = CodeRewardConfig(sandbox=_cfg(wall_seconds=3.0))
    assert humaneval_reward_with(PROBLEM, WRONG + CHEATS[cheat], cfg) == 0.0
    assert humaneval_reward_with(PROBLEM, RIGHT, cfg) == 1.0


_HIDE = bytes.maketrans(b"0123456789abcdefghijklmnopqrstuv", b"ghijklmnopqrstuvGHIJKLMNOPQRSTUV")


@pytest.mark.fault(kind="hostile code", name="read the hidden test")
def test_program_cannot_find_the_test_code():
    """The test's source (with a nonce) is nowhere the program can look: its whole memory, its
    files, the harness's cmdline, environment, descriptors and memory."""
    # the program only holds the nonce translated, and translates what it reads the same way,
    # so its own copy of the needle never matches
    needle = NONCE.encode().translate(_HIDE)
    spy = textwrap.dedent(f"""
        import os
        table, needle, found = {_HIDE!r}, {needle!r}, []
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                try:
                    mem.seek(lo)
                    if needle in mem.read(hi - lo).translate(table):
                        found.append("memory " + line.split()[-1])
                except (OSError, ValueError, OverflowError):
                    pass
        for path in ("/proc/1/cmdline", "/proc/1/environ", "/proc/1/mem", "/tmp/main.py"):
            try:
                if needle in open(path, "rb").read().translate(table):
                    found.append(path)
            except OSError:
                pass
        for fd in os.listdir("/proc/self/fd"):
            try:
                if needle in os.pread(int(fd), 1 << 20, 0).translate(table):
                    found.append("fd " + fd)
            except OSError:
                pass
        print("FOUND" if found else "nothing", found, flush=True)
    """)
    from megatron_darl.rewards.code_exec import humaneval_solution
    from megatron_darl.rewards.sandbox import FunctionCheck

    program = humaneval_solution(PROBLEM, WRONG + spy)
    check = FunctionCheck(PROBLEM["prompt"], PROBLEM["test"], PROBLEM["entry_point"])
    result = run_sandboxed(program, "", _cfg(), check)
    assert result.stdout.startswith("nothing"), result.stdout
    assert result.passed is False
    assert NONCE.encode().translate(_HIDE) == needle != NONCE.encode()


@pytest.mark.fault(kind="hostile code", name="slow stdio program over many cases")
def test_stdio_cases_share_one_time_budget():
    """20 cases of a program that sleeps end after stdio_total_seconds, not 20 x wall."""
    cases = [{"input": str(i), "output": str(i)} for i in range(20)]
    cfg = CodeRewardConfig(sandbox=_cfg(wall_seconds=10.0), stdio_scoring="fraction",
                           stdio_total_seconds=2.0)
    start = time.monotonic()
    assert stdio_reward_with("import time\ntime.sleep(60)", cases, cfg) == 0.0
    assert time.monotonic() - start < 5.0


WORKER = """
import sys
from megatron_darl.rewards.sandbox import SandboxConfig, run_sandboxed
cfg = SandboxConfig(wall_seconds=120, cpu_seconds=120, **eval(sys.argv[1]))
run_sandboxed(sys.argv[2], "", cfg)
"""
SYSTEM_PYTHON = "/usr/bin/python3"


def _sandbox_of(worker: int) -> list[psutil.Process]:
    """The boot, harness and program processes a worker started (they carry its pid in argv)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        ours = cmd[-1:] == [str(worker)] and any("sandbox_boot" in c for c in cmd)
        if ours and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def _kill_worker_mid_run(extra: dict, program: str, processes: int) -> list[psutil.Process]:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    worker = subprocess.Popen([os.sys.executable, "-c", WORKER, repr(extra), program], env=env)
    try:
        deadline = time.monotonic() + 30
        while len(sandbox := _sandbox_of(worker.pid)) < processes:
            assert time.monotonic() < deadline and worker.poll() is None, "sandbox never started"
            time.sleep(0.05)
        worker.kill()
        worker.wait(timeout=10)
        gone, alive = psutil.wait_procs(sandbox, timeout=5)
        return alive
    finally:
        worker.kill()
        worker.wait(timeout=10)


@pytest.mark.fault(kind="hostile code", name="worker SIGKILLed mid-run")
def test_a_killed_worker_takes_its_sandbox_with_it():
    """SIGKILL of the worker kills the boot, the harness, the program and its setsid daemon
    within seconds; nothing is left on the host's disk."""
    before = set(Path("/tmp").glob("darl_sandbox_*"))
    program = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
        time.sleep(3600)
    """)
    alive = _kill_worker_mid_run({}, program, processes=4)
    assert alive == []
    assert set(Path("/tmp").glob("darl_sandbox_*")) == before


@pytest.mark.skipif(not Path(SYSTEM_PYTHON).is_file(), reason="needs /usr/bin/python3")
@pytest.mark.fault(kind="hostile code", name="worker SIGKILLed mid-run (degraded mode)")
def test_a_killed_worker_takes_its_degraded_sandbox_with_it():
    """Without namespaces the chain of parent-death signals still kills everything; the host
    directory left behind is swept by the next run."""
    extra = {"namespaces": False, "allow_degraded": True, "python": SYSTEM_PYTHON}
    before = set(Path("/tmp").glob("darl_sandbox_*"))
    alive = _kill_worker_mid_run(extra, "import time\ntime.sleep(3600)\n", processes=3)
    assert alive == []
    left = set(Path("/tmp").glob("darl_sandbox_*")) - before
    assert left  # the dead worker's directory, until the next run sweeps it
    from megatron_darl.rewards import sandbox

    sandbox._SWEPT.clear()
    run_sandboxed("pass", "", SandboxConfig(**extra))
    assert not any(p.exists() for p in left)


@pytest.mark.skipif(not Path(SYSTEM_PYTHON).is_file(), reason="needs /usr/bin/python3")
@pytest.mark.fault(kind="hostile code", name="degraded mode: fork, socket, kill, early exit")
def test_degraded_mode_keeps_its_kernel_walls(victim, listener):
    """With namespaces off, the program still runs as a uid of its own with seccomp: no fork,
    no socket, no signal to others, and an early exit still scores 0."""
    port, _, _ = listener
    cfg = _cfg(namespaces=False, allow_degraded=True, python=SYSTEM_PYTHON)
    code = PRELUDE + textwrap.dedent(f"""
        attempt("fork", os.fork)
        attempt("thread", lambda: __import__("threading").Thread(target=print).start() or 1/0)
        attempt("socket", lambda: socket.create_connection(("127.0.0.1", {port}), 1))
        attempt("kill victim", lambda: os.kill({victim}, 9))
        attempt("kill worker", lambda: os.kill({os.getpid()}, 9))
        attempt("setsid", os.setsid)
        attempt("write /etc", lambda: open("/etc/owned", "w"))
    """)
    result = run_sandboxed(code, "", cfg)
    out = _assert_all_refused(result, ["fork", "socket", "kill victim", "kill worker", "setsid",
                                       "write /etc"])
    assert out["thread"] == "refused ZeroDivisionError"  # threads still work
    assert result.isolation == "degraded" and result.uid > 0
    assert not Path("/etc/owned").exists()
    code_cfg = CodeRewardConfig(sandbox=cfg)
    assert humaneval_reward_with(PROBLEM, WRONG + CHEATS["os._exit(0)"], code_cfg) == 0.0
    assert humaneval_reward_with(PROBLEM, RIGHT, code_cfg) == 1.0
