"""The run's secret and the control store's address, out of reach of a degraded sandbox.

In degraded mode (no namespaces) a sandboxed program of a non-root worker runs as the worker's
uid. It found the run secret in the worker's ``/proc/PID/environ`` (removing it from
``os.environ`` does not touch the initial environment the kernel shows there), the control store
listening on every interface although its host was 127.0.0.1, and the store's port in a 0644
``run_config.yaml``. Here a real launcher (``launch.procs.Launcher`` with the specs
``launch.train.process_specs`` builds) starts a real unprivileged worker (uid 65534, the system
python) that takes its secret the way every child does and runs a real degraded sandbox.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import socket
import stat
import sys
from pathlib import Path

import psutil
import pytest

from launch.config import load_run_config, save_run_config
from launch.procs import TRAINER, Launcher
from launch.slurm import write_plan
from launch.train import process_specs
from megatron_darl.ports import free_port
from megatron_darl.transport import ControlPlaneConfig, connect_store, serve_store
from megatron_darl.transport.control_store import LEDGER_KEY

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"

# The worker: takes the secret with launch.lifeline.with_run_secret (what launch.trainer and
# launch.rollout do at start), then runs a program in a degraded sandbox (namespaces off).
WORKER = """
import dataclasses, hashlib, importlib.util, os, sys
sys.path.insert(0, sys.argv[1])
from launch.lifeline import with_run_secret

@dataclasses.dataclass
class Control:
    secret: str = ""

@dataclasses.dataclass
class Transport:
    control: Control

@dataclasses.dataclass
class Cfg:
    transport: Transport

cfg = with_run_secret(Cfg(Transport(Control())), os.environ)
print("worker", os.getuid(), hashlib.sha256(cfg.transport.control.secret.encode()).hexdigest(), flush=True)
spec = importlib.util.spec_from_file_location("sbx", sys.argv[1] + "/megatron_darl/rewards/sandbox.py")
sbx = sys.modules["sbx"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sbx)
cfg = sbx.SandboxConfig(namespaces=False, allow_degraded=True, python=sys.executable, wall_seconds=20)
result = sbx.run_sandboxed(sys.argv[2], "", cfg)
print("sandbox", result.isolation, result.uid, flush=True)
print(result.stdout, result.stderr[-500:], flush=True)
"""

# The program: every ancestor's environment and readable memory, searched for anything shaped
# like the run secret (it does not know the secret: its source is in the worker's memory).
PROGRAM = r"""
import os, re
shape = re.compile(rb"darlsecret[0-9a-f]{32}")
pid = os.getppid()
while pid > 1:
    for what in ("environ", "mem"):
        try:
            if what == "environ":
                data = open(f"/proc/{pid}/environ", "rb").read()
            else:
                data = b""
                with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
                    for line in maps:
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        if "r" in line.split()[1] and hi - lo < 1 << 28:
                            try:
                                mem.seek(lo)
                                data += mem.read(hi - lo)
                            except OSError:
                                pass
            found = sorted({m.decode() for m in shape.findall(data)})
            print(f"pid {pid} {what}: read", *found, flush=True)
        except OSError as exc:
            print(f"pid {pid} {what}: refused {exc.errno}", flush=True)
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
"""


def _readable_by_others(path: Path) -> bool:
    return bool(path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO))


@pytest.mark.skipif(os.geteuid() != 0 or not Path(SYSTEM_PYTHON).is_file(),
                    reason="needs root (to start the worker as an unprivileged user) and /usr/bin/python3")
@pytest.mark.fault(kind="secret", name="degraded sandbox reads the worker's environment and memory")
def test_a_degraded_program_cannot_find_the_run_secret(tmp_path, fault_record):
    """A launched worker gets the run secret, yet a degraded sandbox program of the worker's uid finds it neither in the worker's /proc/PID/environ nor in its memory; run_config.yaml is 0600."""
    if not all(os.stat(p).st_mode & 0o005 == 0o005 for p in [REPO, *REPO.parents]):
        pytest.skip(f"{REPO} is not readable by an unprivileged user")
    tmp_path.chmod(0o755)
    secret = "darlsecret" + secrets.token_hex(16)
    cfg = load_run_config(["cluster=cpu", f"loop.run_dir={tmp_path}"])
    config_path = save_run_config(cfg, tmp_path / "run_config.yaml")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    spec = next(s for s in process_specs(cfg, config_path, 0, base_env=env, secret=secret) if s.role != TRAINER)
    log = tmp_path / "worker.log"
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c", WORKER,
            str(REPO), PROGRAM]
    worker = dataclasses.replace(spec, role=TRAINER, argv=argv, log_path=log, reason_path=None)
    assert Launcher([worker], grace_s=5.0).run().code == 0, log.read_text()
    out = log.read_text()
    assert f"worker 65534 {hashlib.sha256(secret.encode()).hexdigest()}" in out, out  # it got the secret
    assert "sandbox degraded 65534" in out and "environ: " in out, out
    assert secret not in out, out  # the program found it nowhere
    assert not _readable_by_others(config_path) and str(cfg.transport.control.port) in config_path.read_text()
    fault_record["observed"] = "; ".join(line for line in out.splitlines() if line.startswith("pid "))[:300]


@pytest.mark.fault(kind="secret", name="control store listening on every interface")
def test_the_control_store_listens_only_where_configured(tmp_path, fault_record):
    """With host 127.0.0.1 the store and its ledger listen on 127.0.0.1 only: other addresses of this machine refuse connections; the plan file naming its port is 0600."""
    port = free_port()
    control = ControlPlaneConfig(host="127.0.0.1", port=port, secret="s", store_timeout_s=10)
    store = serve_store(control)
    client = connect_store(control, "test client")
    try:
        ledger_port = int(client.get(LEDGER_KEY))  # the staleness counters' server, beside the store
        listening = {c.laddr.ip for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port in (port, ledger_port)}
        assert listening == {"127.0.0.1"}, listening
        client.set("k", "v")
        assert store.get("k") == b"v"
        assert client.add("stale/groups_started", 2) == store.add("stale/groups_started", 0) == 2
        others = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                         if a.family == socket.AF_INET and not a.address.startswith("127.")})
        for address in others:
            for p in (port, ledger_port):
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((address, p), timeout=5).close()
    finally:
        client.close()
        store.close()
    plan = write_plan(tmp_path / "plan.sh", {"CONTROL_ADDR": "127.0.0.1", "CONTROL_PORT": port})
    assert not _readable_by_others(plan)
    fault_record["observed"] = (f"store and ledger listening on {sorted(listening)} only; connections to "
                                f"{others or 'no other address'} refused; plan.sh mode 0600")


def test_a_secret_file_open_to_others_is_refused(tmp_path):
    """DARL_RUN_SECRET_FILE must be the user's own (0600): one line naming the file otherwise."""
    from launch.lifeline import RUN_SECRET_FILE, take_run_secret

    path = tmp_path / "run_secret"
    path.write_text("abc\n")
    path.chmod(0o644)
    env = {RUN_SECRET_FILE: str(path)}
    with pytest.raises(ValueError, match=f"{RUN_SECRET_FILE}={path}: .*mode 0644"):
        take_run_secret(env)
    path.chmod(0o600)
    env = {RUN_SECRET_FILE: str(path), "OTHER": "1"}
    assert take_run_secret(env) == "abc" and env == {"OTHER": "1"}
    if sys.platform == "linux":
        assert b"abc" not in Path("/proc/self/environ").read_bytes()
