"""Hostile programs against the sandbox's walls: each one tries to reach the host.

It tries to write, remount or read host files, connect to a host listener, join the host's network
namespace, leave a daemon behind, signal the worker or harness, make dangerous syscalls, use
privileges or setuid binaries, or do all of it from a subinterpreter. Each test checks the host
side: the canary directory unchanged, the listener without a connection, the victim process and
this worker alive, no process of the run left. Host files the program should see but not touch
are exposed read-only through ``readonly_paths``; ``victim`` stands for the rollout worker's
other processes. docs/sandbox.md lists these attacks and what stops each.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from hostile_sandbox import NR, PRELUDE, assert_all_refused, host_untouched, sandbox_cfg, survivors
from megatron_darl.rewards.sandbox import run_sandboxed


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
    result = run_sandboxed(code, "", sandbox_cfg(host))
    out = assert_all_refused(result, ["remount b'/'", "mount tmpfs", "write canary", "umount"])
    assert out["write canary"] == "refused EROFS"
    host_untouched(host)


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
    result = run_sandboxed(code, "", sandbox_cfg(host))
    assert_all_refused(result, ["open", "os.open", "pathlib", "shutil.copy", "rename",
                                 "hardlink", "chmod", "unlink", "truncate", "write /usr"])
    host_untouched(host)


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
    result = run_sandboxed(code, "", sandbox_cfg(host))
    assert_all_refused(result, ["open dir_fd", "open canary dir_fd", "mkdir dir_fd",
                                 "unlink dir_fd", "symlink dir_fd", "rename dir_fds",
                                 "O_PATH reopen", "chmod dir_fd", "utime dir_fd"])
    host_untouched(host)
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
    result = run_sandboxed(code, "", sandbox_cfg(host))
    out = assert_all_refused(result, ["shadow", "secret file", "root home", "worker environ",
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
    result = run_sandboxed(code, "", sandbox_cfg())
    assert_all_refused(result, [f"tcp {a}" for a in addrs] + ["abstract unix", "vsock", "packet"])
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
    result = run_sandboxed(code, "", sandbox_cfg())
    out = assert_all_refused(result, ["setns 1", "setns 2", "unshare user+net",
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
    result = run_sandboxed(code, "", sandbox_cfg(wall_seconds=20.0))
    assert result.ok and result.stdout == "parent done\n", result
    assert time.monotonic() - start < 10.0  # not the 20 s wall clock
    assert survivors(result, wait=0.0) == []


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
    result = run_sandboxed(code, "", sandbox_cfg())
    names = [f"{k} {n}" for n in ("victim", "worker", "harness") for k in ("kill", "killpg", "tgkill", "pidfd")]
    assert_all_refused(result, names + ["kill -1", "prlimit harness", "ptrace harness"])
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
    result = run_sandboxed(code, "", sandbox_cfg())
    out = assert_all_refused(result, [n for n in names if n in NR] + ["ioctl TIOCSTI"])
    wrong = {n: v for n, v in out.items() if v != "refused EPERM" and n != "beyond reviewed"}
    assert not wrong, wrong
    assert out["beyond reviewed"] == "refused ENOSYS"


@pytest.mark.fault(kind="hostile code", name="run as root or keep capabilities")
def test_program_has_no_privileges():
    """The program's uid is not root on the host, every capability set is empty, no_new_privs
    and two seccomp filters are on."""
    code = "print(open('/proc/self/status').read())"
    result = run_sandboxed(code, "", sandbox_cfg())
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
    result = run_sandboxed(code, "", sandbox_cfg())
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
    result = run_sandboxed(code, "", sandbox_cfg(host))
    assert_all_refused(result, ["write", "kill", "connect"])
    host_untouched(host)
    assert psutil.Process(victim).status() != psutil.STATUS_ZOMBIE
