"""Each way untrusted code could hurt the rollout worker is contained by the sandbox: infinite
loops, fork bombs, memory hogs, huge outputs, writes outside the temp dir, reading the parent's
environment, opening sockets. Where the kernel layer (network namespace) is available it is
also checked with the Python guard switched off."""

import os
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_darl.rewards.sandbox import SandboxConfig, run_sandboxed

FAST = SandboxConfig(wall_seconds=3.0, cpu_seconds=2)


def test_normal_program_runs_with_stdin_and_clean_env():
    result = run_sandboxed("import os, sys\nprint(sys.stdin.read()[::-1])\nprint(sorted(os.environ))",
                           "abc", FAST)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "cba"
    assert set(eval(lines[1])) <= {"HOME", "TMPDIR", "LC_ALL", "LC_CTYPE"}


def test_infinite_loop_is_killed_within_the_limits():
    start = time.monotonic()
    result = run_sandboxed("while True:\n    pass\n", "", SandboxConfig(wall_seconds=2.0, cpu_seconds=30))
    assert time.monotonic() - start < 6.0
    assert result.timed_out and not result.ok
    assert result.returncode == -9


def test_cpu_limit_kills_a_busy_program_before_the_wall_clock():
    result = run_sandboxed("while True:\n    pass\n", "", SandboxConfig(wall_seconds=20.0, cpu_seconds=1))
    assert not result.ok and not result.timed_out
    assert result.returncode < 0  # SIGXCPU / SIGKILL from RLIMIT_CPU


def test_blocking_sleep_is_killed_by_the_wall_clock():
    result = run_sandboxed("import time\ntime.sleep(60)", "", SandboxConfig(wall_seconds=1.0))
    assert result.timed_out and not result.ok


FORK_BOMB = "import os\nwhile True:\n    os.fork()\n"
RESILIENT_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


def _sandbox_descendants(since: float) -> list:
    """Sandboxed processes started after ``since`` still alive anywhere (orphans included)."""
    alive = []
    for p in psutil.process_iter(["cmdline", "create_time", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ("sandbox_boot" in cmd and p.info["create_time"] >= since - 1
                and p.info["status"] != psutil.STATUS_ZOMBIE):
            alive.append(p)
    return alive


def test_fork_bomb_is_contained():
    start, since = time.monotonic(), time.time()
    result = run_sandboxed(FORK_BOMB, "", FAST)
    assert time.monotonic() - start < 6.0
    assert not result.ok
    assert "os.fork is not allowed" in result.stderr
    assert _sandbox_descendants(since) == []


def _system_python() -> str:
    """An interpreter `nobody` can run, so the kernel layer (uid drop + RLIMIT_NPROC) is used."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(candidate).is_file():
            return candidate
    return ""


def test_fork_bomb_without_python_guard_is_bounded_by_nproc_and_the_group_kill():
    cfg = SandboxConfig(wall_seconds=1.5, cpu_seconds=2, max_processes=16, python_guard=False)
    if os.getuid() == 0:
        cfg.python = _system_python()
        if not cfg.python or run_sandboxed("", "", cfg).uid == 0:
            pytest.skip("root without an interpreter `nobody` can run: RLIMIT_NPROC cannot bind")
    since = time.time()
    result = run_sandboxed(RESILIENT_BOMB, "", cfg)
    assert not result.ok and result.timed_out
    assert result.uid != 0
    time.sleep(0.2)
    assert _sandbox_descendants(since) == []


def test_memory_hog_fails_inside_the_child():
    before = psutil.Process().memory_info().rss
    result = run_sandboxed("x = bytearray(8 << 30)\nprint('allocated')", "", FAST)
    assert not result.ok
    assert "allocated" not in result.stdout
    assert "MemoryError" in result.stderr
    assert psutil.Process().memory_info().rss - before < 256 << 20


def test_huge_output_is_capped_and_the_run_killed():
    cfg = SandboxConfig(wall_seconds=10.0, max_output_bytes=64 << 10)
    start = time.monotonic()
    result = run_sandboxed("while True:\n    print('x' * 10000)\n", "", cfg)
    assert result.output_truncated and not result.ok
    assert len(result.stdout) <= 64 << 10
    assert time.monotonic() - start < 5.0


def test_huge_file_is_stopped_by_the_file_size_limit():
    cfg = SandboxConfig(wall_seconds=5.0, file_size_bytes=1 << 20)
    result = run_sandboxed("with open('big', 'wb') as f:\n    f.write(b'0' * (8 << 20))", "", cfg)
    assert not result.ok


@pytest.mark.parametrize("code", [
    "open({target!r}, 'w').write('owned')",
    "import os\nfd = os.open({target!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'owned')",
    "import pathlib\npathlib.Path({target!r}).write_text('owned')",
    "import shutil\nopen('x', 'w').write('owned')\nshutil.copy('x', {target!r})",
])
def test_write_outside_the_temp_dir_is_refused(tmp_path, code):
    target = str(tmp_path / f"escape_{uuid.uuid4().hex}.txt")
    result = run_sandboxed(code.format(target=target), "", FAST)
    assert not result.ok
    assert not Path(target).exists()


def test_read_only_mounts_alone_stop_writes_outside(tmp_path):
    cfg = SandboxConfig(wall_seconds=5.0, python_guard=False)
    target = tmp_path / "escape.txt"
    code = f"open('inside.txt', 'w').write('ok')\nopen({str(target)!r}, 'w').write('owned')"
    result = run_sandboxed(code, "", cfg)
    if result.filesystem_isolation != "mountns":
        pytest.skip("no mount namespace here (needs CAP_SYS_ADMIN); the audit hook is the fallback")
    assert not result.ok and "Read-only file system" in result.stderr
    assert not target.exists()
    probe = tmp_path / "host_still_writable"
    probe.write_text("yes")  # the read-only view never leaks to the worker
    assert probe.read_text() == "yes"


def test_writes_inside_the_temp_dir_are_allowed_and_removed():
    result = run_sandboxed("import os\nopen('a.txt', 'w').write('hi')\nprint(os.getcwd())\n"
                           "print(os.path.expanduser('~'))", "", FAST)
    assert result.ok, result.stderr
    cwd, home = result.stdout.split()
    assert cwd == home and "darl_sandbox_" in cwd
    assert not Path(cwd).exists()  # the temp dir is gone afterwards


def test_parent_environment_is_not_visible(monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("DARL_TEST_SECRET", secret)
    code = ("import os\nprint(os.environ.get('DARL_TEST_SECRET'))\n"
            "try:\n    print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\n"
            "except Exception as exc:\n    print('refused', type(exc).__name__)\n")
    result = run_sandboxed(code, "", FAST)
    assert secret not in result.stdout and secret not in result.stderr
    assert result.stdout.splitlines()[0] == "None"
    assert "refused" in result.stdout


SOCKET = """
import socket
try:
    s = socket.create_connection(("1.1.1.1", 80), timeout=2)
    print("connected")
except Exception as exc:
    print("refused", type(exc).__name__, exc)
"""


def test_sockets_are_refused():
    result = run_sandboxed(SOCKET, "", FAST)
    assert "connected" not in result.stdout
    assert "refused" in result.stdout
    assert result.network_isolation in ("netns", "audit_hook")


def test_network_namespace_alone_blocks_the_network():
    cfg = SandboxConfig(wall_seconds=5.0, python_guard=False)
    result = run_sandboxed(SOCKET, "", cfg)
    if result.network_isolation != "netns":
        pytest.skip("no network namespace here (needs CAP_SYS_ADMIN); the audit hook is the fallback")
    assert "connected" not in result.stdout and "refused" in result.stdout
    probe = run_sandboxed("print(open('/proc/net/dev').read())", "", cfg)
    interfaces = [line.split(":")[0].strip() for line in probe.stdout.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]


@pytest.mark.parametrize("code", [
    "import ctypes\nctypes.CDLL(None).system(b'echo owned')",
    "import ctypes\nctypes.pythonapi.system(b'echo owned')",
    "import sys\nsys.modules['ctypes'].CDLL(None).system(b'echo owned')",
    "import subprocess\nsubprocess.run(['echo', 'owned'])",
    "import os\nos.system('echo owned')",
])
def test_guard_bypasses_through_ctypes_or_subprocesses_are_refused(code):
    result = run_sandboxed(code, "", FAST)
    assert not result.ok and "owned" not in result.stdout
    assert "sandbox:" in result.stderr or "KeyError" in result.stderr


def test_sandbox_failure_never_raises_in_the_worker():
    result = run_sandboxed("import sys\nsys.exit(7)", "", FAST)
    assert result.returncode == 7 and not result.ok
    result = run_sandboxed("def f(:\n", "", FAST)  # syntax error
    assert not result.ok and "SyntaxError" in result.stderr
