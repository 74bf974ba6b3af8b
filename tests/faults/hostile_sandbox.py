"""What the hostile-program tests share: the prelude a program uses to try a call and print
whether it got through, the parsers of those lines, the sandbox config they run under, and the
checks on the host side (the canary directory unchanged, no process of the run left alive).

The host fixtures (``host``, ``victim``, ``listener``) live in ``tests/faults/conftest.py``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from megatron_darl.rewards.sandbox import SandboxConfig
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


def outcomes(result) -> dict[str, str]:
    out = {}
    for line in result.stdout.splitlines():
        if ": " in line:
            name, _, verdict = line.partition(": ")
            out[name] = verdict
    return out


def assert_all_refused(result, names) -> dict[str, str]:
    seen = outcomes(result)
    assert set(names) <= set(seen), (result.stdout, result.stderr)
    escaped = {n: v for n, v in seen.items() if v.startswith("ESCAPED")}
    assert not escaped, escaped
    return seen


def survivors(result, wait: float = 3.0) -> list[str]:
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


def sandbox_cfg(host: Path | None = None, **kw) -> SandboxConfig:
    kw.setdefault("wall_seconds", 5.0)
    kw.setdefault("cpu_seconds", 4)
    paths = SandboxConfig().readonly_paths + ((str(host),) if host else ())
    return SandboxConfig(readonly_paths=paths, **kw)


def host_untouched(host: Path) -> None:
    assert (host / "canary.txt").read_text() == "original"
    assert sorted(p.name for p in host.iterdir()) == ["canary.txt", "secret.txt"]
    assert oct((host / "canary.txt").stat().st_mode)[-3:] == "644"
