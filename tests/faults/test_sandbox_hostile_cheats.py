"""Hostile programs that try to fake a reward, and workers that die under a running sandbox.

A wrong HumanEval solution that exits early, kills its harness or patches the check still scores
0, and a correct one still scores 1 (the verdict is the harness's, not the exit code); the hidden
test is nowhere the program can read. A rollout worker SIGKILLed mid-run takes its whole sandbox
with it, with and without namespaces, and the degraded mode (no namespaces) keeps its kernel
walls.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from hostile_sandbox import PRELUDE, assert_all_refused, sandbox_cfg
from megatron_darl.rewards.code_exec import humaneval_reward_with
from megatron_darl.rewards.config import CodeRewardConfig
from megatron_darl.rewards.sandbox import SandboxConfig, run_sandboxed


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
    cfg = CodeRewardConfig(sandbox=sandbox_cfg(wall_seconds=3.0))
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
    result = run_sandboxed(program, "", sandbox_cfg(), check)
    assert result.stdout.startswith("nothing"), result.stdout
    assert result.passed is False
    assert NONCE.encode().translate(_HIDE) == needle != NONCE.encode()


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
    cfg = sandbox_cfg(namespaces=False, allow_degraded=True, python=SYSTEM_PYTHON)
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
    out = assert_all_refused(result, ["fork", "socket", "kill victim", "kill worker", "setsid",
                                       "write /etc"])
    assert out["thread"] == "refused ZeroDivisionError"  # threads still work
    assert result.isolation == "degraded" and result.uid > 0
    assert not Path("/etc/owned").exists()
    code_cfg = CodeRewardConfig(sandbox=cfg)
    assert humaneval_reward_with(PROBLEM, WRONG + CHEATS["os._exit(0)"], code_cfg) == 0.0
    assert humaneval_reward_with(PROBLEM, RIGHT, code_cfg) == 1.0
