"""Memory bounded per program, not per process: a run's processes share one cgroup limit.

RLIMIT_AS bounds each process, so six forked children each under a 1 GiB limit held 3.4 GiB.
The program here runs in the real sandbox with its real cgroup (v2, or v1 where that is what the
kernel offers, as on the CI machine); the test skips, saying why, only where this process can
create no cgroup at all (docs/sandbox.md says what stays unbounded then).
"""

from __future__ import annotations

import textwrap

import psutil
import pytest

from megatron_darl.rewards.sandbox import SandboxConfig, run_sandboxed
from megatron_darl.rewards.sandbox_cgroup import cgroup_backend

GIB = 1 << 30

# Children are started one at a time; each allocates (and touches) 600 MB and holds it, so the
# run holds k x 600 MB once k children hold theirs. The parent reports how many are holding at
# the end, then releases them and exits 0: only the kernel can make this run fail.
FORKS = textwrap.dedent("""
    import os, select, signal, time
    r, w = os.pipe()
    kids, held = [], 0
    for i in range(6):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            data = b"x" * (600 << 20)
            os.write(w, b"+")
            time.sleep(60)
            os._exit(0)
        kids.append(pid)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until it holds its 600 MB or is gone
            if select.select([r], [], [], 0.05)[0]:
                held += len(os.read(r, 1))
                break
            if os.waitpid(pid, os.WNOHANG)[0]:
                kids.remove(pid)
                break
    alive = [pid for pid in kids if os.waitpid(pid, os.WNOHANG)[0] == 0]
    print(f"held {held} holding {len(alive)}", flush=True)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
""")


@pytest.mark.fault(kind="hostile code", name="six forked children of 600 MB each (memory per program)")
def test_forked_children_share_one_memory_limit(fault_record):
    """Six children allocating 600 MB each under a 1 GiB limit: the run is OOM-killed inside its cgroup and fails as out of memory; the whole program never holds more than 1 GiB."""
    backend, why = cgroup_backend()
    if backend is None:
        pytest.skip(f"this process can create no cgroup ({why})")
    before = psutil.virtual_memory().available
    cfg = SandboxConfig(wall_seconds=90, cpu_seconds=60, memory_bytes=GIB, max_processes=16)
    result = run_sandboxed(FORKS, "", cfg)
    assert result.cgroup == f"v{backend.version}", result
    assert result.memory_exceeded and not result.ok, result
    held, holding = (int(w) for w in result.stdout.split()[1::2])
    assert holding <= 1 and held >= 1, result.stdout  # one 600 MB at a time fits in 1 GiB
    assert 0 < result.memory_peak_bytes <= GIB, result.memory_peak_bytes
    assert result.error == "" and result.returncode == 0  # the program's parent lived: no worker error
    assert psutil.virtual_memory().available > before - GIB  # nothing of it is left holding memory
    fault_record["observed"] = (f"cgroup v{backend.version}: {held} of 6 children got their 600 MB, at most "
                                f"{holding} held it at once, peak {result.memory_peak_bytes / GIB:.2f} GiB, "
                                "memory_exceeded, scored as a failure")
    fault_record["lost"] = "nothing (the program fails, as it should)"


def test_a_run_within_its_memory_is_unaffected():
    """One child of 300 MB under the same limit: not OOM-killed, the run passes."""
    backend, why = cgroup_backend()
    if backend is None:
        pytest.skip(f"this process can create no cgroup ({why})")
    code = FORKS.replace("range(6)", "range(1)").replace("600 << 20", "300 << 20")
    result = run_sandboxed(code, "", SandboxConfig(wall_seconds=60, memory_bytes=GIB))
    assert result.ok and not result.memory_exceeded and result.stdout == "held 1 holding 1\n", result
