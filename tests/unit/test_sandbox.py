"""The code sandbox runs a program with its stdin, a clean environment and its limits, inside
namespaces with a private root and a uid of its own; it refuses loudly where the kernel will not
isolate (and runs degraded only when asked). Hostile programs are in tests/faults."""

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from megatron_darl.rewards.sandbox import (
    SandboxConfig,
    SandboxUnavailableError,
    run_sandboxed,
    sandbox_mode,
)

FAST = SandboxConfig(wall_seconds=3.0, cpu_seconds=2)
REWARDS = Path(__file__).resolve().parents[2] / "megatron_darl" / "rewards"
SYSTEM_PYTHON = "/usr/bin/python3"


def test_normal_program_runs_with_stdin_and_clean_env():
    result = run_sandboxed("import os, sys\nprint(sys.stdin.read()[::-1])\nprint(sorted(os.environ))",
                           "abc", FAST)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "cba"
    assert set(eval(lines[1])) <= {"HOME", "TMPDIR", "LC_ALL", "LC_CTYPE"}
    assert result.isolation == "namespaces"


def test_each_run_gets_its_own_unprivileged_uid():
    a, b = (run_sandboxed("import os\nprint(os.getuid())", "", FAST) for _ in range(2))
    assert a.ok and b.ok
    assert int(a.stdout) == a.uid and int(b.stdout) == b.uid
    if os.getuid() == 0:
        assert a.uid != b.uid and min(a.uid, b.uid) >= SandboxConfig().uid_base


def test_infinite_loop_is_killed_within_the_limits():
    start = time.monotonic()
    result = run_sandboxed("while True:\n    pass\n", "", SandboxConfig(wall_seconds=2.0, cpu_seconds=30))
    assert time.monotonic() - start < 8.0  # wall 2 s + the TERM grace; the CPU limit alone: 30 s
    assert result.timed_out and not result.ok and result.returncode is None


def test_cpu_limit_kills_a_busy_program_before_the_wall_clock():
    result = run_sandboxed("while True:\n    pass\n", "", SandboxConfig(wall_seconds=20.0, cpu_seconds=1))
    assert not result.ok and not result.timed_out
    assert result.returncode < 0  # SIGXCPU / SIGKILL from RLIMIT_CPU


def test_blocking_sleep_is_killed_by_the_wall_clock():
    result = run_sandboxed("import time\ntime.sleep(60)", "", SandboxConfig(wall_seconds=1.0))
    assert result.timed_out and not result.ok


def test_writes_go_to_a_private_tmpfs_that_vanishes():
    name = f"darl_probe_{uuid.uuid4().hex}"
    code = (f"import os\nopen({name!r}, 'w').write('hi')\nprint(os.getcwd(), os.path.expanduser('~'))\n"
            f"print(os.path.exists('/tmp/{name}'))")
    result = run_sandboxed(code, "", FAST)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["/tmp", "/tmp", "True"]
    assert not (Path("/tmp") / name).exists()  # the host's /tmp never saw it


def test_readonly_paths_are_visible_but_not_writable(tmp_path):
    tmp_path.chmod(0o755)
    (tmp_path / "data.txt").write_text("shared")
    (tmp_path / "data.txt").chmod(0o644)
    cfg = SandboxConfig(wall_seconds=3.0, readonly_paths=FAST.readonly_paths + (str(tmp_path),))
    code = (f"print(open({str(tmp_path / 'data.txt')!r}).read())\n"
            f"open({str(tmp_path / 'x')!r}, 'w')")
    result = run_sandboxed(code, "", cfg)
    assert result.stdout == "shared\n" and "Read-only file system" in result.stderr
    assert not (tmp_path / "x").exists()


def test_exit_status_and_errors_are_reported_never_raised():
    result = run_sandboxed("import sys\nsys.exit(7)", "", FAST)
    assert result.returncode == 7 and not result.ok
    result = run_sandboxed("def f(:\n", "", FAST)  # syntax error
    assert not result.ok and result.returncode == 1 and "SyntaxError" in result.stderr
    result = run_sandboxed("raise ValueError('boom')", "", FAST)
    assert "ValueError: boom" in result.stderr and "sandbox_boot" not in result.stderr
    assert run_sandboxed("import atexit\natexit.register(print, 'bye')\nexit(3)", "", FAST).returncode == 3


def test_atexit_hooks_and_threads_finish_like_python():
    code = textwrap.dedent("""
        import atexit, threading, time
        atexit.register(lambda: print("atexit"))
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread"))).start()
        print("main", end="")
    """)
    result = run_sandboxed(code, "", FAST)
    assert result.ok and result.stdout == "mainthread\natexit\n"


@pytest.mark.parametrize("kwargs, match", [
    ({"wall_seconds": 0}, "wall_seconds"), ({"disk_bytes": -1}, "disk_bytes"),
    ({"uid_base": 0}, "uid_base"), ({"readonly_paths": ("relative",)}, "readonly_paths"),
    ({"readonly_paths": ("/",)}, "readonly_paths"), ({"namespaces": False}, "allow_degraded"),
])
def test_bad_config_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SandboxConfig(**kwargs)


REFUSING_PARENT = """
import sys
sys.path.insert(0, sys.argv[1])
import sandbox_seccomp
sandbox_seccomp.install(sandbox_seccomp.base_filter(degraded=False))  # like a container's profile
from megatron_darl.rewards.sandbox import SandboxConfig, SandboxUnavailableError, run_sandboxed, sandbox_mode
try:
    sandbox_mode(SandboxConfig())
    print("NOT REFUSED")
except SandboxUnavailableError as exc:
    print("REFUSED", exc)
cfg = SandboxConfig(allow_degraded=True, python=sys.argv[2])
result = run_sandboxed("import os\\nprint(os.getuid())", "", cfg)
print("DEGRADED", sandbox_mode(cfg), result.isolation, result.ok, result.stdout.strip())
"""


@pytest.mark.skipif(not Path(SYSTEM_PYTHON).is_file(), reason="needs /usr/bin/python3")
def test_kernel_refusal_is_loud_and_degraded_mode_needs_the_flag():
    """A worker whose own seccomp profile forbids unshare/mount (as in a default container)."""
    env = {**os.environ, "PYTHONPATH": str(REWARDS.parents[1])}
    out = subprocess.run([sys.executable, "-c", REFUSING_PARENT, str(REWARDS), SYSTEM_PYTHON],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("REFUSED code sandbox: the kernel refused the sandbox's namespaces")
    assert "allow_degraded=True" in lines[0] and "docs/sandbox.md" in lines[0]
    assert "code sandbox DEGRADED" in out.stderr
    mode, isolation, ok, uid = lines[1].split()[1:]
    assert (mode, isolation, ok) == ("degraded", "degraded", "True") and int(uid) > 0


UNPRIVILEGED_WORKER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sbx", sys.argv[1] + "/sandbox.py")
sbx = importlib.util.module_from_spec(spec)
sys.modules["sbx"] = sbx
spec.loader.exec_module(sbx)
cfg = sbx.SandboxConfig(wall_seconds=10, python=sys.executable)
code = "import os\\nprint(os.getuid(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])\\n" \\
       "open('/etc/owned', 'w')"
r = sbx.run_sandboxed(code, "", cfg)
print(sbx.sandbox_mode(cfg), r.isolation, r.uid, r.stdout.strip(), "EROFS" if "Read-only" in r.stderr else r.stderr)
"""


def _world_readable(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [path, *path.parents])


@pytest.mark.skipif(os.getuid() != 0 or not Path(SYSTEM_PYTHON).is_file(),
                    reason="needs root (to become an unprivileged user) and /usr/bin/python3")
def test_unprivileged_worker_gets_a_user_namespace():
    """Run by a non-root worker, the sandbox builds the same isolation inside a user namespace
    (root inside = the worker's uid outside, no capabilities)."""
    if not _world_readable(REWARDS):
        pytest.skip(f"{REWARDS} is not readable by an unprivileged user")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          SYSTEM_PYTHON, "-c", UNPRIVILEGED_WORKER, str(REWARDS)],
                         capture_output=True, text=True, timeout=60, cwd="/")
    if "refused the sandbox's namespaces" in out.stderr + out.stdout:
        pytest.skip("unprivileged user namespaces are disabled on this kernel")
    assert out.returncode == 0, out.stderr
    mode, isolation, uid, inner_uid, cap_eff, erofs = out.stdout.split()
    assert (mode, isolation, uid, inner_uid) == ("userns", "namespaces", "65534", "0")
    assert int(cap_eff, 16) == 0 and erofs == "EROFS"


def test_sandbox_mode_is_the_full_isolation_here():
    assert sandbox_mode(SandboxConfig()) == ("root" if os.geteuid() == 0 else "userns")


def test_stdin_larger_than_the_file_size_limit_still_arrives():
    cfg = SandboxConfig(wall_seconds=5.0, file_size_bytes=1 << 20)
    result = run_sandboxed("import sys\nprint(len(sys.stdin.read()))", "x" * (3 << 20), cfg)
    assert result.ok and result.stdout == f"{3 << 20}\n"


ORDINARY = """
import asyncio, multiprocessing as mp, socket, sqlite3, subprocess, tempfile, threading
def square(x):
    return x * x
with mp.Pool(2) as pool:
    print(pool.map(square, range(4)))
print(subprocess.run(["echo", "hi"], capture_output=True, text=True).stdout.strip())
with tempfile.NamedTemporaryFile() as f:
    print(f.name.startswith("/tmp/"))
print(asyncio.run(asyncio.sleep(0.01, result=7)))
a, b = socket.socketpair()
a.send(b"x")
print(b.recv(1), sqlite3.connect(":memory:").execute("select 1").fetchone())
"""


def test_ordinary_programs_still_work():
    """Processes, threads, pipes, semaphores, temp files, asyncio and sqlite pass the filter."""
    result = run_sandboxed(ORDINARY, "", SandboxConfig(wall_seconds=20.0))
    assert result.ok, result.stderr
    assert result.stdout.split("\n")[:5] == ["[0, 1, 4, 9]", "hi", "True", "7", "b'x' (1,)"]
