"""The launch timeline: when each process of a run reached each start-up milestone.

A Qwen3-1.7B launch took 331-412 s to its first trained step, and no log said where the time
went: the launcher, the trainer ranks and the rollout workers are separate processes (separate
Slurm job steps on a cluster), each with its own log. So each process appends its milestones to
``<run_dir>/timeline/<who>.jsonl`` (wall-clock times: processes on several nodes share no
monotonic clock), and trainer rank 0 reads them all after the first trained step and after the
first checkpoint, logs one line of phases and writes ``<run_dir>/launch_timeline.json``
(``{"t0": unix seconds, "phases": {name: seconds}, "events": {...}}``), which the benchmarks copy
into their records. A phase whose end a run never reached (the checkpoint load of a fresh run)
is left out, not zero.

A process records through the module-level ``mark(event)``, like ``logging``: the entry point
(``launch/``) calls ``start(run_dir, who)`` once, and library code marks milestones without being
handed a recorder; ``mark`` does nothing in a process that never started one (a test, a tool).
The launcher (``launch.train``, ``launch.slurm prepare``) starts the timeline of a launch with
``begin``, which clears the last launch's files, so a resumed run's timeline is its own.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)
TIMELINE_DIR = "timeline"
SUMMARY = "launch_timeline.json"

# The phases: (name, from, to). An endpoint is "<who pattern>:<event>"; "*" in who takes the
# latest of all matching processes (the run waits for the slowest), "t0" is the launch.
PHASES = (
    ("processes_started", "t0", "*:process_start"),  # launcher: config, checks, spawning
    ("launcher_imports", "t0", "launch:main_start"),  # the launcher's own imports
    ("launcher_config", "launch:main_start", "launch:config_loaded"),  # Hydra compose, the split
    ("launcher_checks", "launch:config_loaded", "launch:inputs_checked"),  # preflight, run dir, prompts
    ("trainer_imports", "trainer0:process_start", "trainer0:imports"),  # torch, Megatron
    ("model_load", "trainer0:parallel", "trainer0:weights_loaded"),  # build, HF load, conversion
    ("trainer_ready", "t0", "trainer0:trainer_ready"),
    ("checkpoint_load", "trainer0:trainer_ready", "trainer0:checkpoint_loaded"),  # resumed runs only
    ("trainer_compile", "trainer0:warm_up_start", "trainer0:warmed_up"),  # warm-up passes only
    ("engine_start", "rollout*:process_start", "rollout*:engine_ready"),  # per worker, slowest
    ("engine_ready", "t0", "rollout*:engine_ready"),
    ("first_weights", "t0", "rollout*:first_weights"),  # every worker holds valid weights
    ("first_groups", "t0", "trainer0:first_groups"),  # step 0's groups are in
    ("first_step", "trainer0:first_groups", "trainer0:first_step"),  # step 0 itself
    ("launch_to_first_step", "t0", "trainer0:first_step"),
    ("first_checkpoint", "t0", "trainer0:first_checkpoint"),
)


@dataclass
class _Recorder:
    path: Path
    who: str


_recorder: _Recorder | None = None
_noted: dict[str, float] = {}  # events a launcher reached before ``begin`` (``note``)


def process_start_time() -> float:
    """When this process started (unix seconds): its interpreter start, imports included."""
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # noqa: BLE001 (no psutil, no /proc: the moment we were asked)
        return time.time()


def begin(run_dir: str | Path, who: str = "launch") -> None:
    """Start a launch's timeline: clear the last launch's files, then ``start`` this process,
    its start (the moment the user launched) being t0."""
    folder = Path(run_dir) / TIMELINE_DIR
    if folder.is_dir():
        for f in folder.glob("*.jsonl"):
            f.unlink(missing_ok=True)
    (Path(run_dir) / SUMMARY).unlink(missing_ok=True)
    start(run_dir, who)
    mark("launch", process_start_time())
    for event, at in _noted.items():
        mark(event, at)
    _noted.clear()


def note(event: str) -> None:
    """This launcher reached ``event`` now, before its launch's timeline exists (``begin`` comes
    once the run dir is settled, and clears the last launch's files): ``begin`` marks it."""
    _noted.setdefault(event, time.time())


def start(run_dir: str | Path, who: str) -> None:
    """Record this process's milestones as ``who`` (e.g. ``trainer0``, ``rollout1``) from now on,
    beginning with its own start."""
    global _recorder
    folder = Path(run_dir) / TIMELINE_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{who}.jsonl"
        path.write_text("")  # a process started again (a restarted worker) starts its file again
    except OSError as exc:  # a timeline is worth no run: say so once and record nothing
        log.warning("launch timeline off for %s: %s", who, exc)
        return
    _recorder = _Recorder(path, who)
    mark("process_start", process_start_time())


def mark(event: str, at: float | None = None) -> None:
    """This process reached ``event`` (now, or at unix time ``at``); nothing without ``start``."""
    rec = _recorder
    if rec is None:
        return
    line = json.dumps({"who": rec.who, "event": event, "t": time.time() if at is None else at})
    try:
        with rec.path.open("a") as f:
            f.write(line + "\n")
    except OSError:
        pass  # a full disk must not stop a run over its timeline


def read(run_dir: str | Path) -> dict[str, dict[str, float]]:
    """who -> event -> unix time (the first time each process marked each event)."""
    out: dict[str, dict[str, float]] = {}
    for path in sorted((Path(run_dir) / TIMELINE_DIR).glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
                out.setdefault(str(row["who"]), {}).setdefault(str(row["event"]), float(row["t"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill
    return out


def _at(events: Mapping[str, Mapping[str, float]], point: str, t0: float) -> float | None:
    if point == "t0":
        return t0
    who, event = point.split(":")
    if who.endswith("*"):
        times = [ev[event] for name, ev in events.items() if name.startswith(who[:-1]) and event in ev]
        return max(times) if times else None
    return events.get(who, {}).get(event)


def phases(events: Mapping[str, Mapping[str, float]]) -> tuple[float, dict[str, float]]:
    """(t0, phase -> seconds) of the phases whose two ends were both reached.

    t0 is the launcher's start, or the earliest process start when no launcher marked one
    (a job step started by hand). A per-worker phase (``rollout*`` at both ends) is the slowest
    worker's.
    """
    starts = [ev["process_start"] for ev in events.values() if "process_start" in ev]
    t0 = events.get("launch", {}).get("launch", min(starts) if starts else 0.0)
    out: dict[str, float] = {}
    for name, a, b in PHASES:
        if a.startswith("rollout*") and b.startswith("rollout*"):
            spans = [ev[b.split(":")[1]] - ev[a.split(":")[1]] for who, ev in events.items()
                     if who.startswith("rollout") and a.split(":")[1] in ev and b.split(":")[1] in ev]
            if spans:
                out[f"{name}_seconds"] = max(spans)
            continue
        ta, tb = _at(events, a, t0), _at(events, b, t0)
        if ta is not None and tb is not None:
            out[f"{name}_seconds"] = tb - ta
    return t0, out


def summarize(run_dir: str | Path) -> dict[str, float]:
    """Write ``launch_timeline.json`` from the processes' files and return its phases."""
    events = read(run_dir)
    t0, out = phases(events)
    rel = {who: {e: round(t - t0, 3) for e, t in ev.items()} for who, ev in events.items()}
    path = Path(run_dir) / SUMMARY
    try:
        path.write_text(json.dumps({"t0": t0, "phases": out, "events": rel}, indent=1) + "\n")
    except OSError as exc:
        log.warning("could not write %s: %s", path, exc)
    return out


def saved_phases(run_dir: str | Path) -> dict[str, float]:
    """The phases of the run's ``launch_timeline.json`` (its last launch), {} without one: what
    the benchmarks copy into their records."""
    try:
        phases = json.loads((Path(run_dir) / SUMMARY).read_text()).get("phases", {})
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in phases.items() if isinstance(v, (int, float))}


def describe(p: Mapping[str, float]) -> str:
    """One line of the phases a user reads first."""
    parts = [f"{label} {p[key]:.1f} s" for label, key in (
        ("processes up", "processes_started_seconds"), ("model load", "model_load_seconds"),
        ("trainer ready", "trainer_ready_seconds"), ("checkpoint load", "checkpoint_load_seconds"),
        ("trainer compile", "trainer_compile_seconds"),
        ("engine start", "engine_start_seconds"), ("first weights", "first_weights_seconds"),
        ("first groups", "first_groups_seconds"), ("first step", "first_step_seconds"),
        ("first checkpoint", "first_checkpoint_seconds")) if key in p]
    total = p.get("launch_to_first_step_seconds")
    head = f"first trained step done {total:.1f} s after launch" if total is not None else "launch"
    return f"{head} ({', '.join(parts)})"
