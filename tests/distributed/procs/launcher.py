"""Start test programs as separate process trees and make sure none outlives the test.

Every program runs in its own session (``start_new_session=True``), as a Slurm job step would,
with its output in a log file that failing tests print. ``Procs.close`` kills every session that
is still alive, so nothing is left behind even when an assertion fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_darl.ports import free_port  # noqa: F401 (the tests' port picker)

REPO = Path(__file__).resolve().parents[3]


class Procs:
    """A set of named child process trees with logs under ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, module: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.procs[name] = proc
        return proc

    def wait(self, name: str, timeout: float) -> int:
        """Exit code of ``name``; raises ``AssertionError`` with its log on timeout."""
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not exit within {timeout} s\n{self.logs()}") from None

    def kill(self, name: str) -> None:
        """``kill -9`` the whole process tree of ``name``."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def logs(self) -> str:
        parts = []
        for name in self.procs:
            text = (self.log_dir / f"{name}.log").read_text()[-3000:]
            parts.append(f"----- {name} -----\n{text}")
        return "\n".join(parts)

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stray grandchildren in the session
            except (ProcessLookupError, PermissionError):
                pass


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05) -> float:
    """Poll ``predicate`` until true; returns the time it became true, raises on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.time()
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
