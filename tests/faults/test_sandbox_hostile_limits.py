"""Hostile programs against the sandbox's limits: each one tries to use up a host resource.

Fork, memory, disk and inode bombs, huge output, sleeping forever, ignoring every signal, a busy
loop, and a slow program over many stdio cases: each stops at its limit, the run ends, and no
process of it survives. docs/sandbox.md lists the limits.
"""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time

import psutil
import pytest

from hostile_sandbox import sandbox_cfg, survivors
from megatron_darl.rewards.code_exec import stdio_reward_with
from megatron_darl.rewards.config import CodeRewardConfig
from megatron_darl.rewards.sandbox import run_sandboxed


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
    result = run_sandboxed(code, "", sandbox_cfg(max_processes=16))
    assert result.ok, result
    assert 0 < int(result.stdout) <= 16 - 2  # the harness and the program itself count
    assert survivors(result, wait=0.0) == []
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
    result = run_sandboxed(code, "", sandbox_cfg(memory_bytes=512 << 20))
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
    cfg = sandbox_cfg(disk_bytes=24 << 20, file_size_bytes=64 << 20)
    result = run_sandboxed(code, "", cfg)
    err, total = result.stdout.split()
    assert err == "ENOSPC" and int(total) <= 24 << 20
    big = run_sandboxed("open('f', 'wb').write(b'x' * (4 << 20))", "", sandbox_cfg(file_size_bytes=1 << 20))
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
    result = run_sandboxed(code, "", sandbox_cfg(disk_inodes=500))
    err, n = result.stdout.split()
    assert err == "ENOSPC" and int(n) < 500


@pytest.mark.fault(kind="hostile code", name="huge output")
def test_huge_output_is_capped_and_the_run_killed():
    """Past max_output_bytes the run is killed; the worker holds at most the cap."""
    start = time.monotonic()
    result = run_sandboxed("while True:\n    print('x' * 10000)\n", "",
                           sandbox_cfg(max_output_bytes=64 << 10, wall_seconds=20.0))
    assert result.output_truncated and not result.ok
    assert len(result.stdout) <= 64 << 10
    assert time.monotonic() - start < 10.0
    assert survivors(result) == []


@pytest.mark.fault(kind="hostile code", name="sleep forever")
def test_sleeping_forever_is_killed_at_the_wall_clock():
    """A program (and a child) sleeping forever is killed at wall_seconds; nothing survives."""
    code = "import os, time\nos.fork()\ntime.sleep(3600)\n"
    start = time.monotonic()
    result = run_sandboxed(code, "", sandbox_cfg(wall_seconds=1.5))
    assert result.timed_out and not result.ok
    assert time.monotonic() - start < 7.0  # wall 1.5 s + the TERM grace (the sleep: an hour)
    assert survivors(result, wait=0.0) == []


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
    result = run_sandboxed(code, "", sandbox_cfg(wall_seconds=1.5))
    assert result.timed_out
    assert survivors(result, wait=0.0) == []


@pytest.mark.fault(kind="hostile code", name="busy loop")
def test_busy_loop_hits_the_cpu_limit():
    """A spinning program is stopped by RLIMIT_CPU before the wall clock."""
    result = run_sandboxed("while True:\n    pass\n", "", sandbox_cfg(cpu_seconds=1, wall_seconds=30.0))
    assert not result.ok and not result.timed_out
    assert result.returncode in (-signal.SIGXCPU, -signal.SIGKILL)


@pytest.mark.fault(kind="hostile code", name="slow stdio program over many cases")
def test_stdio_cases_share_one_time_budget():
    """20 cases of a program that sleeps end after stdio_total_seconds, not 20 x wall."""
    cases = [{"input": str(i), "output": str(i)} for i in range(20)]
    cfg = CodeRewardConfig(sandbox=sandbox_cfg(wall_seconds=10.0), stdio_scoring="fraction",
                           stdio_total_seconds=2.0)
    start = time.monotonic()
    assert stdio_reward_with("import time\ntime.sleep(60)", cases, cfg) == 0.0
    assert time.monotonic() - start < 7.0  # 2 s total + the TERM grace; per case: 20 x 10 s
