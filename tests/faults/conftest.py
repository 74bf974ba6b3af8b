"""Fault-injection tier: record every ``@pytest.mark.fault`` test for ``docs/reliability.md``.

Convention (shared by every file of this tier): each test is marked
``@pytest.mark.fault(kind="<class>", name="<short name>")`` and its docstring's first line says
what must happen. This plugin writes, for each such test, its kind, name, that line, the outcome
and what the test observed (``fault_record`` fixture, optional) to a JSON file:
``$DARL_FAULTS_REPORT`` when set, else ``faults/results.json`` under the pytest cache (or under
the temp dir with ``-p no:cacheprovider``). ``python tools/reliability_report.py`` renders it.
Run outputs are never committed; only the rendered document is.

The host fixtures of the hostile-program tests (``test_sandbox_hostile_*.py``) live here too: a
host directory the sandbox sees read-only, a process it must not signal, sockets it must not
reach.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

_RESULTS: dict[str, dict] = {}  # nodeid -> record, in run order
_OUTCOME_RANK = {"passed": 0, "skipped": 1, "failed": 2}
_TMP = re.compile(r"/\S*?pytest-of-[^/]+/pytest-\d+/[^/\s'\"]+")  # a test's tmp_path, in messages


def report_path(config: pytest.Config) -> Path:
    """Where this session's records go (see the module docstring)."""
    explicit = os.environ.get("DARL_FAULTS_REPORT")
    if explicit:
        return Path(explicit)
    cache = getattr(config, "cache", None)
    base = Path(cache.mkdir("faults")) if cache is not None else Path(tempfile.gettempdir()) / "darl_faults"
    return base / "results.json"


def _record(item: pytest.Item) -> dict | None:
    marker = item.get_closest_marker("fault")
    if marker is None:
        return None
    if item.nodeid not in _RESULTS:
        fn = getattr(item, "function", None)
        doc = ((fn.__doc__ if fn is not None else "") or "").strip().splitlines()
        _RESULTS[item.nodeid] = {
            "kind": marker.kwargs.get("kind", "unclassified"),
            "name": marker.kwargs.get("name", item.name),
            "must": doc[0].strip() if doc else "",
            "test": item.nodeid,
            "param": getattr(getattr(item, "callspec", None), "id", ""),
            "outcome": "passed", "observed": "", "lost": "", "seconds": 0.0,
        }
    return _RESULTS[item.nodeid]


@pytest.fixture
def fault_record(request) -> dict:
    """A dict the test may fill: ``observed`` (what happened, measured) and ``lost`` (what was
    lost; "nothing" is the target). Both land in the report."""
    record = _record(request.node)
    return record if record is not None else {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    record = _record(item)
    if record is None:
        return
    rep = outcome.get_result()
    record["seconds"] += float(rep.duration)
    got = "skipped" if rep.skipped else ("failed" if rep.failed else "passed")
    if _OUTCOME_RANK[got] > _OUTCOME_RANK[record["outcome"]]:
        record["outcome"] = got
        if rep.failed:
            text = str(rep.longrepr).strip().splitlines()
            record["observed"] = (text[-1] if text else "failed")[:300]


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 (pytest hook signature)
    if not _RESULTS:
        return
    path = report_path(session.config)
    path.parent.mkdir(parents=True, exist_ok=True)
    for record in _RESULTS.values():
        record["observed"] = _TMP.sub("<tmp>", record["observed"])
        if not record["lost"]:
            record["lost"] = "nothing" if record["outcome"] == "passed" else "unknown (test did not pass)"
    payload = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "records": list(_RESULTS.values())}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"fault records: {path} (render: python tools/reliability_report.py {path})")


# ---- host fixtures of the hostile-program tests -----------------------------------------------
@pytest.fixture
def host(tmp_path):
    """A host directory the sandbox sees read-only: a canary (0644) and a secret (0600)."""
    d = tmp_path / "host"
    d.mkdir()
    (d / "canary.txt").write_text("original")
    (d / "secret.txt").write_text(f"secret-{uuid.uuid4().hex}")
    (d / "secret.txt").chmod(0o600)
    d.chmod(0o755)
    tmp_path.chmod(0o755)
    return d


@pytest.fixture
def victim():
    """A host process of the worker's (root) that the program must not be able to signal."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc.pid
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def listener():
    """A TCP listener on every host address and an abstract unix socket, both of this host."""
    tcp = socket.socket()
    tcp.bind(("0.0.0.0", 0))
    tcp.listen(16)
    tcp.setblocking(False)
    unix = socket.socket(socket.AF_UNIX)
    name = f"darl-hostile-{uuid.uuid4().hex}"
    unix.bind("\0" + name)
    unix.listen(16)
    unix.setblocking(False)
    addrs = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                    if a.family == socket.AF_INET})
    yield tcp.getsockname()[1], name, addrs
    for s in (tcp, unix):
        with pytest.raises(BlockingIOError):
            s.accept()  # nobody connected
        s.close()
