"""A cgroup per sandboxed run: the memory and processes of the whole program, bounded together.

Why: rlimits bound each process, so a program that forks six children, each under an address
space limit of 1 GiB, holds 3.4 GiB. Each run gets a cgroup of its own that the boot process
joins before anything else happens (``sandbox_boot``), so the harness, the program and every
process it forks are in it, and the kernel bounds them together:

- memory: ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) = ``SandboxConfig.memory_bytes``,
  swap included where the kernel accounts it (``memory.swap.max`` 0, ``memory.memsw.*``); past
  it the kernel OOM-kills a process of the run (the program's first: they run with
  ``oom_score_adj`` 1000) and the run is reported as ``memory_exceeded``;
- processes: ``pids.max`` = ``max_processes`` + 1 (the boot), threads included;
- leftovers: when the run ends, whatever is still in the cgroup is killed (``cgroup.kill``, or
  SIGKILL to each pid on v1) and the cgroup is removed.

Where: cgroup v2 under the worker's own cgroup when memory and pids can be enabled for its
children (the hierarchy's root, or a delegated subtree) or under ``SandboxConfig.cgroup_parent``
(a delegated v2 directory, e.g. from ``systemd-run --scope -p Delegate=yes``); else the cgroup v1
memory (and pids, when mounted) hierarchies under the worker's own groups. Where none of these
is writable, runs have no cgroup: ``cgroup="auto"`` logs once what stays unbounded (see
docs/sandbox.md), ``"require"`` refuses to run. Parent side only (the worker's process).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_NAME = "darl_sandbox_{pid}_{n}"
_STALE = re.compile(r"darl_sandbox_(\d+)_\d+$")


@dataclass(frozen=True)
class CgroupBackend:
    """Where runs' cgroups go: ``version`` 2 or 1, and the parent directory per controller
    ("" for v2's single hierarchy, "memory" and maybe "pids" for v1)."""

    version: int
    parents: dict[str, Path]

    def describe(self) -> str:
        return f"cgroup v{self.version} under {', '.join(str(p) for p in self.parents.values())}"


def _mountinfo() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of every cgroup mount."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                mounts.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return mounts


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _join(mount_root: str, mount_point: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy rooted at ``mount_root``."""
    root = mount_root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    return Path(mount_point + path[len(root):])


def _v2_parent(directory: Path) -> Path | None:
    """``directory`` when its children can have memory.max and pids.max (enabling them if
    needed and allowed), else None."""
    try:
        if not {"memory", "pids"} <= set((directory / "cgroup.controllers").read_text().split()):
            return None
        enabled = set((directory / "cgroup.subtree_control").read_text().split())
        if not {"memory", "pids"} <= enabled:
            (directory / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError:
        return None  # not there, not ours, or processes in it (cgroup v2's no-internal-process rule)
    return directory


def _candidates(cgroup_parent: str) -> list[CgroupBackend]:
    if cgroup_parent:
        parent = _v2_parent(Path(cgroup_parent))
        return [CgroupBackend(2, {"": parent})] if parent else []
    own, found = _own_paths(), []
    mounts = _mountinfo()
    for root, point, fstype, options in mounts:
        if fstype == "cgroup2" and "" in own:
            directory = _join(root, point, own[""])
            parent = _v2_parent(directory) if directory else None
            if parent:
                found.append(CgroupBackend(2, {"": parent}))
    v1 = {}
    for root, point, fstype, options in mounts:
        for controller in ("memory", "pids"):
            if fstype == "cgroup" and controller in options and controller in own and controller not in v1:
                directory = _join(root, point, own[controller])
                if directory is not None and directory.is_dir():
                    v1[controller] = directory
    if "memory" in v1:
        found.append(CgroupBackend(1, v1))
    return found


class RunCgroup:
    """The cgroup of one run (a directory per controller hierarchy), limits written."""

    _ids = iter(range(1, 1 << 62))
    _ids_lock = threading.Lock()

    def __init__(self, backend: CgroupBackend, memory_bytes: int, max_pids: int) -> None:
        with RunCgroup._ids_lock:
            name = _NAME.format(pid=os.getpid(), n=next(RunCgroup._ids))
        self.backend = backend
        self.dirs: dict[str, Path] = {}
        try:
            for controller, parent in backend.parents.items():
                self.dirs[controller] = parent / name
                os.mkdir(self.dirs[controller], 0o755)
            self._limit(memory_bytes, max_pids)
        except OSError:
            self.close()
            raise

    def _limit(self, memory_bytes: int, max_pids: int) -> None:
        if self.backend.version == 2:
            d = self.dirs[""]
            _write(d / "memory.max", memory_bytes)
            _write(d / "memory.swap.max", 0, optional=True)  # absent without swap accounting
            _write(d / "pids.max", max_pids)
            return
        memory = self.dirs["memory"]
        _write(memory / "memory.limit_in_bytes", memory_bytes)
        _write(memory / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
        if "pids" in self.dirs:
            _write(self.dirs["pids"] / "pids.max", max_pids)

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the boot writes its pid into (every hierarchy)."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def oom_kills(self) -> int:
        """Processes of the run the kernel OOM-killed for the cgroup's memory limit."""
        text = self._read("memory.events" if self.backend.version == 2 else "memory.oom_control")
        match = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(match.group(1)) if match else 0

    def memory_peak(self) -> int:
        """Most memory the run held at once (bytes; -1 where the kernel does not say)."""
        text = self._read("memory.peak" if self.backend.version == 2 else "memory.max_usage_in_bytes")
        return int(text) if text.strip().isdigit() else -1

    def _read(self, name: str) -> str:
        try:
            return (self.dirs["" if self.backend.version == 2 else "memory"] / name).read_text()
        except OSError:
            return ""

    def close(self, timeout_s: float = 2.0) -> None:
        """Kill what is left in the cgroup and remove it (best effort, bounded)."""
        deadline = time.monotonic() + timeout_s
        for controller, d in self.dirs.items():
            while d.is_dir():
                try:
                    os.rmdir(d)
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("sandbox cgroup %s not removed: %s", d, exc)
                        break
                    _kill_members(d)
                    time.sleep(0.01)


def _write(path: Path, value: int, optional: bool = False) -> None:
    try:
        path.write_text(str(value))
    except FileNotFoundError:
        if not optional:
            raise


def _kill_members(directory: Path) -> None:
    try:
        (directory / "cgroup.kill").write_text("1")  # v2, Linux 5.14+
        return
    except OSError:
        pass
    try:
        pids = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:  # only the run's processes are in its cgroup
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _sweep(backend: CgroupBackend) -> None:
    """Remove the cgroups that dead workers left behind (SIGKILLed before their cleanup)."""
    for parent in backend.parents.values():
        for entry in parent.glob("darl_sandbox_*"):
            match = _STALE.match(entry.name)
            if match and not Path(f"/proc/{match.group(1)}").exists():
                try:
                    os.rmdir(entry)
                except OSError:
                    pass


_BACKENDS: dict[str, CgroupBackend | None] = {}
_REASONS: dict[str, str] = {}
_LOCK = threading.Lock()


def cgroup_backend(cgroup_parent: str = "") -> tuple[CgroupBackend | None, str]:
    """(backend, "") where runs can get a cgroup, else (None, why not); probed once per parent
    by creating and removing a cgroup with limits."""
    with _LOCK:
        if cgroup_parent not in _BACKENDS:
            _BACKENDS[cgroup_parent], _REASONS[cgroup_parent] = _probe(cgroup_parent)
        return _BACKENDS[cgroup_parent], _REASONS[cgroup_parent]


def _probe(cgroup_parent: str) -> tuple[CgroupBackend | None, str]:
    try:
        candidates = _candidates(cgroup_parent)
    except (OSError, ValueError) as exc:
        return None, f"cannot read this process's cgroups ({exc})"
    errors = []
    for backend in candidates:
        try:
            RunCgroup(backend, 64 << 20, 8).close()
        except OSError as exc:
            errors.append(f"{backend.describe()}: {exc.strerror or exc}")
            continue
        _sweep(backend)
        return backend, ""
    where = cgroup_parent or "this process's cgroups"
    why = "; ".join(errors) or ("no writable cgroup v2 directory with the memory and pids "
                                "controllers and no cgroup v1 memory hierarchy")
    return None, f"no cgroup for sandbox runs in {where} ({why})"
