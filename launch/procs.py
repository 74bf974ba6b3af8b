"""Start the run's roles as separate process trees on one machine and never leave one behind.

``launch.train`` uses this where Slurm would run job steps: N trainer ranks with torchrun-style
environment variables and M rollout workers, each in its own session (so a signal reaches its
whole tree, reward sandboxes included). The launcher:

- forwards SIGTERM/SIGINT to the trainer ranks (they checkpoint, raise the stop flag and
  exit), then SIGTERMs the rest; each phase waits ``grace_s`` before SIGKILL; a second signal
  kills at once;
- on a trainer rank's failure kills everything and exits non-zero naming ``trainer <rank>``;
- on a rollout worker's failure reports it by name and, with ``rollout_failure=continue``, goes
  on while another worker lives (the trainer continues without it, docs/architecture.md, Failures); a worker
  that died without saying why (killed by a signal, or a crash: no exit reason, not the lost
  trainer's exit code) is started again with the same id, up to ``rollout_restarts`` times per
  worker, after ``on_restart`` told the run (the trainer must not count it as gone meanwhile);
  one that gave up on purpose would give up again and is not. With no worker left, the run ends
  naming every one;
- when every trainer rank exited 0, gives the workers ``grace_s`` to see the stop flag, then
  kills stragglers. Exit code: 0, the first failure's code, or 128 + signal.

A child that gives up on purpose writes one line saying why to its ``reason_path``
(``write_exit_reason``); the launcher puts that line into the failure it reports.

If the launcher itself is killed (SIGKILL leaves it no say), its children notice and leave on
their own: each gets the launcher's pid and ``grace_s`` in its environment (``launch.lifeline``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Sequence

from launch.lifeline import LAUNCHER_GRACE, LAUNCHER_PID, RUN_SECRET_FD, secret_pipe
from megatron_darl.exit_codes import ExitCode

log = logging.getLogger(__name__)
TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass
class ProcSpec:
    """One child process."""

    role: str  # "trainer" or "rollout"
    rank: int  # trainer rank or rollout worker id
    argv: list[str]  # command line
    env: dict[str, str]  # full environment of the child
    log_path: Path | None = None  # stdout+stderr file; None = inherit the launcher's
    reason_path: Path | None = None  # where the child writes one line on why it gave up
    secret: str = field(default="", repr=False)  # the run's secret: on an inherited pipe, never in env

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"


@dataclass
class _Child:
    spec: ProcSpec
    proc: subprocess.Popen
    log_file: IO | None = None
    reported: bool = False
    failure: str = ""  # the one line that reported its exit


@dataclass
class LaunchResult:
    """How the run ended."""

    code: int  # the launcher's exit code
    failures: list[str] = field(default_factory=list)  # "trainer 1 exited 3: <log tail>"
    signal: int | None = None  # forwarded signal that ended the run


def exit_reason_path(run_dir: str | Path, role: str, rank: int) -> Path:
    """Where ``role`` ``rank`` of the run in ``run_dir`` says why it exited non-zero."""
    return Path(run_dir) / "logs" / f"{role}{rank}.exit"


def write_exit_reason(path: Path, line: str) -> None:
    """Write the one line (best effort: a full disk must not hide the real error)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(line.split()) + "\n")
    except OSError as exc:
        log.error("could not write %s: %s", path, exc)


def _reason(path: Path | None) -> str:
    if path is None or not path.exists():
        return ""
    try:
        return path.read_text(errors="replace").strip().splitlines()[0]
    except (OSError, IndexError):
        return ""


def _tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n    " + "\n    ".join(text) if text else ""


class Launcher:
    """Run ``specs`` to completion under the policy in the module docstring."""

    def __init__(self, specs: Sequence[ProcSpec], grace_s: float = 30.0,
                 rollout_failure: str = "continue", poll_s: float = 0.1, pass_fds: Sequence[int] = (),
                 rollout_restarts: int = 0, on_restart: Callable[[ProcSpec, int], None] | None = None,
                 on_stop: Callable[[int], None] | None = None,
                 on_started: Callable[[], None] | None = None) -> None:
        if not any(s.role == TRAINER for s in specs):
            raise ValueError("need at least one trainer process")
        self.specs, self.grace_s, self.poll_s = list(specs), grace_s, poll_s
        self.pass_fds = tuple(pass_fds)  # inherited by every child (the run dir's lock: launch.run_lock)
        self.rollout_failure = rollout_failure
        self.rollout_restarts = rollout_restarts  # per worker
        self.restarts: dict[int, int] = {}  # rollout worker id -> times started again
        self._on_restart = on_restart or (lambda spec, n: None)
        self._on_stop = on_stop or (lambda signum: None)  # before a stop signal is forwarded
        self._on_started = on_started or (lambda: None)  # once every child is started
        self.children: list[_Child] = []
        self._signal: int | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def run(self) -> LaunchResult:
        """Start every child, supervise, and return when none is left."""
        stops = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # USR1: sbatch --signal, no deadline
        previous = {s: signal.signal(s, self._on_signal) for s in stops}
        try:
            for spec in self.specs:
                self.children.append(self._start(spec))
            self._on_started()
            return self._supervise()
        finally:
            self._kill_all(signal.SIGKILL, wait_s=5.0)
            for child in self.children:
                if child.log_file is not None:
                    child.log_file.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _start(self, spec: ProcSpec) -> _Child:
        out = None
        if spec.reason_path is not None:
            spec.reason_path.unlink(missing_ok=True)  # an earlier run's (resume into the same dir)
        if spec.log_path is not None:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = spec.log_path.open("ab")
        env = {**spec.env, LAUNCHER_PID: str(os.getpid()), LAUNCHER_GRACE: str(self.grace_s)}
        secret_fd = secret_pipe(spec.secret) if spec.secret else None
        if secret_fd is not None:
            env[RUN_SECRET_FD] = str(secret_fd)
        try:
            proc = subprocess.Popen(spec.argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True, pass_fds=self.pass_fds + (() if secret_fd is None else (secret_fd,)))
        finally:
            if secret_fd is not None:
                os.close(secret_fd)
        log.info("started %s (pid %d): %s", spec.name, proc.pid, " ".join(spec.argv))
        return _Child(spec, proc, out)

    def _on_signal(self, signum: int, frame) -> None:  # noqa: ARG002 (signal API)
        if self._signal is not None:  # second signal: no more patience
            self._kill_all(signal.SIGKILL, wait_s=0.0)
        self._signal = signum

    # ---- supervision ------------------------------------------------------------------------
    def _supervise(self) -> LaunchResult:
        failures: list[str] = []
        while True:
            if self._signal is not None:
                return self._stop_on_signal(failures)
            failed_code = self._check_children(failures)
            if failed_code is not None:
                self._kill_all(signal.SIGTERM, wait_s=self.grace_s)
                return LaunchResult(failed_code, failures)
            if all(c.proc.poll() is not None for c in self._role(TRAINER)):
                self._wait_role(ROLLOUT, self.grace_s)
                self._kill_all(signal.SIGTERM, wait_s=self.grace_s)
                return LaunchResult(0, failures)
            time.sleep(self.poll_s)

    def _check_children(self, failures: list[str]) -> int | None:
        """Report new failures; restart a worker that may come back; return an exit code when the
        whole run must stop."""
        trainers_done = all(c.proc.poll() == 0 for c in self._role(TRAINER))
        for child in list(self.children):
            code = child.proc.poll()
            if code is None or code == 0 or child.reported:
                continue
            if trainers_done and child.spec.role == ROLLOUT:  # the run is over: not a failure
                child.reported = True
                log.warning("%s exited with code %d after the trainer finished", child.spec.name, code)
                continue
            child.reported = True
            reason = _reason(child.spec.reason_path)
            message = _exit_line(child.spec, code)
            restart = self._may_restart(child.spec, code, reason)
            if restart:
                message += f" (restarting it: restart {restart} of {self.rollout_restarts})"
            child.failure = message
            message += _tail(child.spec.log_path)
            failures.append(message)
            log.error("%s", message)
            if child.spec.role == TRAINER or self.rollout_failure == "abort":
                return code if code > 0 else 128 - code
            if restart:
                self._restart(child, restart)
                continue
            alive = [c for c in self._role(ROLLOUT) if c.proc.poll() is None]
            if not alive and self._role(ROLLOUT):
                gone = "; ".join(c.failure or _exit_line(c.spec, c.proc.poll()) for c in self._role(ROLLOUT))
                failures.insert(0, f"no rollout worker left: {gone}")
                log.error("no rollout worker left (%s): stopping the run", gone)
                return code if code > 0 else 128 - code
        return None

    def _may_restart(self, spec: ProcSpec, code: int, reason: str) -> int:
        """The restart number ``spec`` gets now (1, 2, ...), or 0: not a rollout worker, one that
        said why it left or lost its trainer (a new one would leave too), or out of restarts."""
        if spec.role != ROLLOUT or self.rollout_failure != "continue" or reason or code == ExitCode.TRAINER_LOST:
            return 0
        n = self.restarts.get(spec.rank, 0) + 1
        return n if n <= self.rollout_restarts else 0

    def _restart(self, child: _Child, n: int) -> None:
        """Start ``child``'s process again: its tree gone first (reward sandboxes included), the
        run told, then the same command, environment and log (appended)."""
        _signal_group(child.proc, signal.SIGKILL)
        if child.log_file is not None:
            child.log_file.close()
        self.restarts[child.spec.rank] = n
        try:
            self._on_restart(child.spec, n)
        except Exception as exc:  # noqa: BLE001 - the restart itself matters more than the notice
            log.warning("%s: could not tell the run about its restart: %s", child.spec.name, exc)
        self.children[self.children.index(child)] = self._start(child.spec)

    def _stop_on_signal(self, failures: list[str]) -> LaunchResult:
        """Trainers first (they checkpoint, then raise the stop flag so workers drain), then the
        rest; each gets ``grace_s`` before SIGKILL."""
        signum = self._signal
        log.warning("signal %d: forwarding to the trainer ranks, grace %.0f s", signum, self.grace_s)
        self._on_stop(signum)
        for child in self._role(TRAINER):
            _signal_proc(child.proc, signum)
        self._wait_role(TRAINER, self.grace_s)
        self._kill_all(signal.SIGTERM, wait_s=self.grace_s)
        return LaunchResult(128 + signum, failures, signal=signum)

    def _role(self, role: str) -> list[_Child]:
        return [c for c in self.children if c.spec.role == role]

    def _wait_role(self, role: str, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in self._role(role)):
            time.sleep(self.poll_s)

    def _kill_all(self, signum: int, wait_s: float) -> None:
        """Signal every live child; SIGKILL the groups still alive after ``wait_s``.

        A trainer rank gets a catchable signal alone, not its group: it checkpoints on SIGTERM,
        and its helper processes (dist_checkpointing's writer) must live until it is done.
        """
        for child in self.children:
            if child.spec.role == TRAINER and signum != signal.SIGKILL:
                _signal_proc(child.proc, signum)
            else:
                _signal_group(child.proc, signum)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children):
            time.sleep(min(self.poll_s, 0.05))
        for child in self.children:
            _signal_group(child.proc, signal.SIGKILL)  # the group may outlive its leader
            if child.proc.poll() is None:
                try:
                    child.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %d) did not die after SIGKILL", child.spec.name, child.proc.pid)
        if signum == signal.SIGKILL:  # return only once the grandchildren are gone too
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and _live_groups({c.proc.pid for c in self.children}):
                time.sleep(0.02)


def _exit_line(spec: ProcSpec, code: int | None) -> str:
    """``rollout 0 exited with code -9 (SIGKILL)``, or ``... code 4: <why>`` when it said why."""
    line = f"{spec.name} exited with code {code}"
    if code is not None and code < 0:
        try:
            line += f" ({signal.Signals(-code).name})"
        except ValueError:
            pass
    reason = _reason(spec.reason_path)
    return line + (f": {reason}" if reason else "")


def _signal_proc(proc: subprocess.Popen, signum: int) -> None:
    """Signal the child process alone."""
    if proc.poll() is None:
        try:
            proc.send_signal(signum)
        except (ProcessLookupError, PermissionError):
            pass


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Signal the child's whole session (its pid is the group id: ``start_new_session``)."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _live_groups(pgids: set[int]) -> set[int]:
    """The process groups among ``pgids`` with a member that is not a zombie (Linux ``/proc``;
    elsewhere nothing is reported and the caller does not wait). A SIGKILLed process lingers
    for a moment before it exits; returning before then would leave it briefly visible."""
    live: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) in pgids:
            live.add(int(fields[2]))
    return live
