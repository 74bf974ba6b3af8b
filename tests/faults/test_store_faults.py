"""Faults of the control-plane store: a frozen store host, and processes outside the run.

Real processes, real sockets, a real TCPStore: the store host is frozen with SIGSTOP (as a
stuck or swapped-out trainer rank 0 would be), and the intruder is a separate process that
reaches the port without the run's secret.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_darl.exit_codes import ExitCode
from megatron_darl.transport import (
    TRAINER, WORKER, ControlPlaneConfig, Heartbeat, HeartbeatConfig, MemberInfo, TransportTimeout, connect_store,
)
from megatron_darl.transport.shape import StalenessBound
from megatron_darl.transport.store import ForeignValueError, Keys
from tests.distributed.procs.launcher import free_port, wait_for
from tests.distributed.procs.scenario import Scenario

REPO = Path(__file__).resolve().parents[2]
HB_TIMEOUT = 4.0  # the procs' --hb-timeout default
SLACK = 2.5  # heartbeat interval + polling + a loaded 2-core machine

_SERVER = """
import sys, time
from megatron_darl.transport import ControlPlaneConfig, serve_store
store = serve_store(ControlPlaneConfig(port=int(sys.argv[1]), secret=sys.argv[2], store_timeout_s=30))
store.set("k", "v")
print("ready", flush=True)
time.sleep(600)
"""


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all(_state(t) in ("T", "t") for t in Path(f"/proc/{pid}/task").iterdir()), 10,
             f"pid {pid} stopped")


def _state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "T"  # the thread is gone


def _serve(port: int, secret: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), secret], cwd=REPO,
                            stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            start_new_session=True)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


@pytest.mark.fault(kind="process", name="store host frozen (SIGSTOP), each call type")
def test_every_store_call_has_a_deadline_when_the_store_host_is_frozen(fault_record):
    """Every store call type returns within its deadline naming the frozen host; it works again after SIGCONT."""
    port = free_port()
    server = _serve(port, "s3cret")
    cfg = ControlPlaneConfig(port=port, secret="s3cret", store_timeout_s=10, call_timeout_s=1.0)
    store = connect_store(cfg, who="rollout 0 (test)")
    threads_before = threading.active_count()
    try:
        assert store.get("k") == b"v"
        freeze(server.pid)
        calls = {"check": lambda: store.check(["k"]), "read": lambda: store.read("k"),
                 "get": lambda: store.get("k"), "add": lambda: store.add("n", 1),
                 "delete": lambda: store.delete_key("k"),
                 "wait": lambda: store.wait(["absent"], 5.0, "a key nobody sets")}
        waited = {}
        for name, call in calls.items():
            t0 = time.monotonic()
            with pytest.raises(TransportTimeout) as err:
                call()
            waited[name] = time.monotonic() - t0
            assert f"pid {server.pid}" in str(err.value) and "trainer 0" in str(err.value), err.value
            assert "did not answer" in str(err.value)
        assert all(w <= cfg.call_timeout_s + 1.5 for w in waited.values()), waited
        assert threading.active_count() <= threads_before + 3  # stuck calls do not pile up threads
        os.kill(server.pid, signal.SIGCONT)
        wait_for(lambda: _answers(store), 20, "the store answering again after SIGCONT", poll=0.2)
        assert store.get("k") == b"v"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    fault_record["observed"] = ("6 call types each raised TransportTimeout naming trainer 0 (host, pid) after "
                                f"{min(waited.values()):.1f}-{max(waited.values()):.1f} s (deadline "
                                f"{cfg.call_timeout_s:.0f} s per request, a wait slice on top); served again "
                                "after SIGCONT")


@pytest.mark.fault(kind="process", name="a process busy past the heartbeat timeout, its store host alive")
def test_a_heartbeat_that_woke_late_does_not_report_a_live_store_host(fault_record):
    """This process holds the GIL for twice the heartbeat timeout; as its heartbeat thread wakes the
    live store host pauses 0.3 s (a loaded machine): not a loss. The thread's own lateness is not
    the host's silence (seen in CI: a rollout worker loading its model called its trainer frozen)."""
    port = free_port()
    server = _serve(port, "s3cret")
    control = ControlPlaneConfig(port=port, secret="s3cret", store_timeout_s=10, call_timeout_s=1.0)
    # a thread that woke late gets two intervals (0.9 s) for an answer: the 0.3 s pause fits with room
    # for a loaded machine; without that floor the 2 s it was held off would already be a loss
    cfg = HeartbeatConfig(interval_s=0.45, timeout_s=1.0)
    losses: list = []
    beat = Heartbeat(control, cfg, MemberInfo.here(WORKER, 0), on_loss=losses.append,
                     store_is_peer=(TRAINER, 0)).start()
    pauser = subprocess.Popen(["sh", "-c", f"sleep 2.5; kill -STOP {server.pid}; sleep 0.3; kill -CONT {server.pid}"])
    switch = sys.getswitchinterval()
    try:
        time.sleep(0.6)  # beats answered
        sys.setswitchinterval(30.0)  # the heartbeat thread cannot take the GIL from the loop below
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2 * cfg.timeout_s:
            pass
        sys.setswitchinterval(switch)
        assert pauser.wait(10) == 0
        time.sleep(4 * cfg.interval_s)
        assert not losses, losses
    finally:
        sys.setswitchinterval(switch)
        beat.close()
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    fault_record["observed"] = (f"heartbeat thread held off {2 * cfg.timeout_s:.0f} s (timeout {cfg.timeout_s:.0f} s), "
                                "store host paused 0.3 s as it woke: no loss reported")
    fault_record["lost"] = "nothing"


def _answers(store) -> bool:
    try:
        return store.check(["k"])
    except TransportTimeout:
        return False


@pytest.mark.fault(kind="process", name="trainer rank 0 frozen (SIGSTOP) mid-run")
def test_frozen_rank0_is_reported_by_every_peer_within_the_heartbeat_timeout(tmp_path, fault_record):
    """Every rollout worker exits 3 and the other trainer rank reports, naming rank 0, within the heartbeat timeout."""
    sc = Scenario(out=tmp_path, trainers=2, workers=2, stages=1, steps=200, gps=4, eta=1,
                  trainer_args=["--hub-delay-s", "0.05"], secret="run-secret")
    procs = sc.launch()
    try:
        wait_for(lambda: {r["worker"] for r in sc.records("hub0.jsonl")} == {0, 1}, 120,
                 "groups from both workers at the hub (every peer up and beating)")
        rank0 = procs.procs["trainer0"].pid
        t_stop, t_stop_wall = time.monotonic(), time.time()
        freeze(rank0)
        exits = {}
        for name in ("worker0", "worker1"):
            exits[name] = procs.wait(name, HB_TIMEOUT + 30)
            exits[name + "_s"] = time.monotonic() - t_stop
        wait_for(lambda: any(r["rank"] == 0 for r in sc.records("losses.jsonl")), 10, "trainer 1's report")
        loss = next(r for r in sc.records("losses.jsonl") if r["rank"] == 0)
        logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("worker0", "worker1")}
    finally:
        for proc in procs.procs.values():
            _kill(proc.pid, signal.SIGCONT)
        procs.close()
    assert exits["worker0"] == exits["worker1"] == ExitCode.TRAINER_LOST, procs.logs()
    for name in ("worker0", "worker1"):
        assert exits[name + "_s"] <= HB_TIMEOUT + SLACK, exits
        assert f"pid {rank0}" in logs[name] and "trainer 0 (" in logs[name], logs[name][-2000:]
    assert loss["peer"].startswith("trainer 0 (") and f"pid {rank0}" in loss["peer"], loss
    reported_s = loss["time"] - t_stop_wall
    assert reported_s <= HB_TIMEOUT + SLACK, loss
    fault_record["observed"] = (f"workers exited {int(ExitCode.TRAINER_LOST)} after {exits['worker0_s']:.1f} s and "
                                f"{exits['worker1_s']:.1f} s, trainer 1 reported after {reported_s:.1f} s "
                                f"(heartbeat timeout {HB_TIMEOUT:.0f} s), all naming trainer 0 (host, pid)")
    fault_record["lost"] = "the trainer's work since its last checkpoint (a frozen rank 0 writes none; the job stops)"


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


_INTRUDER = """
import datetime, json, socket, struct, sys
import torch.distributed as dist
from megatron_darl.transport import ControlPlaneConfig, connect_store
from megatron_darl.transport.ledger import LedgerClient
from megatron_darl.transport.store import ForeignValueError
port = int(sys.argv[1])
raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
# the staleness counter: down (more starts than the bound allows) where it used to be a store key ...
raw.add("stale/groups_started", -1000)
# ... and up (a stalled run) in the ledger that keeps it, whose port the store shows (signed, readable)
ledger_port = int(raw.get("darl/ledger")[16:])
try:
    LedgerClient("127.0.0.1", ledger_port, "guessed", "intruder", 10).call(
        "add", key="stale/groups_started", amount=1000)
    print("LEDGER MOVED", flush=True)
except Exception as exc:
    print("LEDGER REFUSED", type(exc).__name__, exc, flush=True)
bare = socket.create_connection(("127.0.0.1", ledger_port), timeout=10)  # a request without the handshake
body = json.dumps({"op": "add", "key": "stale/groups_started", "amount": -1000}).encode()
bare.recv(64)
bare.sendall(struct.pack("<I", len(body)) + body)
print("BARE", "closed" if bare.recv(64) == b"" else "answered", flush=True)
raw.set("ctl/stop", "1")  # a bare stop flag
member = json.dumps({"role": "rollout", "rank": 0, "host": "intruder", "pid": 1})
raw.set("rdzv/rollout/0", member)  # pose as worker 0
raw.set("hb/rollout/0", json.dumps({"beat": 10**9, "member": member}))
try:
    connect_store(ControlPlaneConfig(port=port, secret="guessed", store_timeout_s=10), who="intruder")
    print("JOINED", flush=True)
except ForeignValueError as exc:
    print("REFUSED", exc, flush=True)
"""


@pytest.mark.fault(kind="intruder",
                   name="process without the run secret: stop flag, join, forged member, staleness counter")
def test_a_process_without_the_secret_cannot_stop_or_join_the_run(tmp_path, fault_record):
    """A foreign stop flag, member record and heartbeat are ignored, its join is refused, its moves of the staleness counter change nothing and are logged; the run finishes every step within the bound."""
    steps, gps, eta = 30, 4, 1  # long enough that the run still goes on when the intruder (importing torch) acts
    sc = Scenario(out=tmp_path, trainers=1, workers=2, stages=1, steps=steps, gps=gps, eta=eta, secret="run-secret",
                  trainer_args=["--hub-delay-s", "0.05"])  # 6 s more: still going when the intruder is done
    procs = sc.launch()
    try:
        wait_for(lambda: len(sc.records("hub0.jsonl")) >= 2, 120, "2 groups at the hub")
        out = subprocess.run([sys.executable, "-c", _INTRUDER, str(sc.port)], cwd=REPO, capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
        t_forged = time.time()  # every forged key is written by now
        assert procs.wait("trainer0", 180) == 0, procs.logs()
        codes = [procs.wait(f"worker{w}", 30) for w in range(2)]
    finally:
        procs.close()
    assert "REFUSED intruder" in out.stdout and "not this run's" in out.stdout, (out.stdout, out.stderr)
    assert "LEDGER REFUSED" in out.stdout and "BARE closed" in out.stdout, (out.stdout, out.stderr)
    done = sc.records("done.jsonl")
    assert done and done[0]["steps"] == steps
    # the counter was not moved down: no more starts than the bound allows at the last version, no
    # group trained staler than eta (step s trains at version s - 1); nor up: every step was made
    assert done[0]["started"] <= StalenessBound(eta, gps).capacity(steps), done
    ages = [r["step"] - 1 - r["min_token_version"] for r in sc.records("hub0.jsonl") if r["step"] <= steps]
    assert max(ages) <= eta, sorted(ages)
    refusals = [line for line in (tmp_path / "trainer0.log").read_text().splitlines()
                if "control ledger: refused the connection from 127.0.0.1" in line]
    assert len(refusals) == 2, refusals  # both attempts on the ledger, each in one line
    assert any(r["time"] > t_forged for r in sc.records("hub0.jsonl"))  # groups kept flowing after it
    assert codes == [0, 0]
    worker_logs = (tmp_path / "worker0.log").read_text() + (tmp_path / "worker1.log").read_text()
    assert "not signed with this run's secret" in worker_logs
    assert "intruder" not in (tmp_path / "trainer0.log").read_text()
    fault_record["observed"] = (f"forged stop flag ignored (logged), join refused, forged worker record "
                                f"ignored; staleness counter moved -1000 in the store (no effect: it lives in the "
                                f"ledger) and +1000 and -1000 at the ledger (both connections refused, logged); "
                                f"{done[0]['started']} groups started, none trained older than {max(ages)} "
                                f"(eta {eta}); the run finished all {steps} steps and both workers exited 0")


@pytest.mark.fault(kind="intruder", name="joining another run's store (wrong secret)")
def test_joining_with_another_secret_is_refused_by_name(fault_record):
    """A process with another run's secret is refused at connect, naming the store and the secret mismatch."""
    port = free_port()
    server = _serve(port, "run-a")
    try:
        with pytest.raises(ForeignValueError, match="not this run's"):
            connect_store(ControlPlaneConfig(port=port, secret="run-b", store_timeout_s=10), who="rollout 0 of run b")
        mine = connect_store(ControlPlaneConfig(port=port, secret="run-a", store_timeout_s=10), who="rollout 0")
        assert mine.read(Keys.STOP) is None and mine.get("k") == b"v"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    fault_record["observed"] = "ForeignValueError at connect: 'the control store at 127.0.0.1:<port> is not this run's'"
