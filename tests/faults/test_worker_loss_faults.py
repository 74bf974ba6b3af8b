"""One rollout worker is not the run: the main job (``python -m launch.train``, real
trainer and worker processes on CPU) with a rollout worker SIGKILLed in a weight sync or while
generating. The run goes on with the workers that remain, names the loss in one log line and
counts it in the metrics; with ``cluster.rollout_restarts`` the launcher starts the worker again
and it contributes groups again; only losing every worker ends the run, naming each.

The kills come from ``inject/sitecustomize.py`` (``DARL_FAULT=kill:W:sync|generate:N``): the
worker SIGKILLs itself at a chosen point, once (a restarted process runs clean), and leaves
``fault_fired_rollout<W>`` in the run dir.

A worker declared lost that comes back (frozen past the heartbeat timeout, then thawed) runs on
the transport test processes (``tests/distributed/procs``: the real worker, hub, heartbeat and
ledger around a stand-in trainer), which take seconds where the main job takes minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.procs.launcher import wait_for
from tests.distributed.procs.scenario import Scenario

REPO = Path(__file__).resolve().parents[2]
INJECT = Path(__file__).resolve().parent / "inject"


def _command(run_dir: Path, overrides: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "launch.train", "experiment=smoke", f"loop.run_dir={run_dir}",
            "transport.control.port=0", "cluster.master_port=0", "cluster.grace_s=10", *overrides]


def _env(fault: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{INJECT}:{REPO}", "DARL_FAULT": fault}


def _launch(run_dir: Path, fault: str, *overrides: str, timeout: float = 600) -> tuple[int, str]:
    proc = subprocess.run(_command(run_dir, overrides), cwd=REPO, env=_env(fault), capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _loss_lines(out: str, worker: int) -> list[str]:
    """The trainer's one line per lost process of ``worker`` (which worker, why)."""
    return [line for line in out.splitlines() if f"lost rollout {worker} (" in line and " at step " in line]


@pytest.mark.fault(kind="rollout fault", name="kill -9 of rollout 0 of 2 in a weight sync")
def test_a_worker_killed_in_a_weight_sync_is_named_and_the_run_goes_on(tmp_path, fault_record):
    """Rollout 0 of 2 SIGKILLed in a weight sync, no restarts: the run completes its steps on rollout 1; one log line names the loss and why; the metrics count it."""
    run_dir, steps = tmp_path / "run", 12
    code, out = _launch(run_dir, "kill:0:sync:1", "cluster.rollout_workers=2", "cluster.rollout_restarts=0",
                        f"loop.steps={steps}")
    assert (run_dir / "fault_fired_rollout0").exists(), out[-3000:]  # the kill happened
    assert code == 0, out[-3000:]
    rows = _rows(run_dir)
    assert len(rows) == steps and "failed for every rollout worker" not in out
    lost = _loss_lines(out, 0)
    assert len(lost) == 1 and "no heartbeat" in lost[0], lost
    assert rows[-1]["workers_lost"] == 1 and rows[-1]["workers_alive"] == 1, rows[-1]
    # the steps after the one that first counts the loss: that step may have taken rollout 0's
    # groups before the loss was declared
    first = next(i for i, r in enumerate(rows) if r["workers_lost"] == 1)
    after = rows[first:]
    assert all(r["groups_received_w0"] == 0 for r in after[1:]), after
    assert sum(r["groups_received_w1"] for r in after) > 0
    # rollout 1, in the same broadcast as the killed one, is let go once the leader gives up,
    # not after the 300 s collective timeout (one step took 299.8 s when the leader's send to
    # rollout 0 failed before rollout 1's)
    assert max(r["step_seconds"] for r in rows) < 60, [round(r["step_seconds"], 1) for r in rows]
    fault_record["observed"] = (f"rollout 0 killed in its first weight sync; {steps} of {steps} steps done, "
                                f"the last {len(after)} on rollout 1 alone; logged: "
                                f"{lost[0].split(' ERROR ', 1)[-1][:160]}")
    fault_record["lost"] = "rollout 0's share of the generation after the kill (rollout 1 makes up for it)"


@pytest.mark.fault(kind="rollout fault", name="kill -9 of rollout 0 of 2 while generating, restarted")
def test_a_worker_killed_while_generating_is_restarted_and_contributes_again(tmp_path, fault_record):
    """Rollout 0 of 2 SIGKILLed while generating, with restarts: the loss and the groups in flight are counted, the worker is started again and its groups arrive again, ids after its predecessor's, with no step waiting out the dead process's pair."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log_path = tmp_path / "launcher.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(_command(run_dir, ("cluster.rollout_workers=2", "cluster.rollout_restarts=1",
                                                   "loop.steps=2000")),
                                cwd=REPO, env=_env("kill:0:generate:2"), stdout=log, stderr=subprocess.STDOUT)
    try:
        def back() -> bool:
            rows = _rows(run_dir)
            first = next((i for i, r in enumerate(rows) if r["worker_restarts"] >= 1), None)
            return first is not None and any(r["groups_received_w0"] > 0 for r in rows[first + 1:])

        wait_for(back, 400, "groups of the restarted rollout 0", poll=0.5)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    out = log_path.read_text()
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert (run_dir / "fault_fired_rollout0").exists()
    assert "rollout 0 exited with code -9 (SIGKILL) (restarting it: restart 1 of 1)" in out
    lost = _loss_lines(out, 0)
    assert len(lost) == 1, lost
    rows = _rows(run_dir)
    last = rows[-1]
    assert last["workers_lost"] == 1 and last["worker_restarts"] == 1 and last["workers_alive"] == 2, last
    assert last["groups_dropped"] >= 1, last  # the batch it was generating died with it
    rollout0 = (run_dir / "logs" / "rollout0.log").read_text()
    resumed = [line for line in rollout0.splitlines() if "rollout 0: resuming after" in line]
    assert len(resumed) == 1 and int(resumed[0].split("resuming after ")[1].split()[0]) > 0, resumed
    first = next(i for i, r in enumerate(rows) if r["worker_restarts"] >= 1)
    contributed = sum(r["groups_received_w0"] for r in rows[first + 1:])
    # the hub drops the pair the killed process announced once its restart draws a new one: no
    # step waits out the connect timeout (60 s) for a worker that is gone (one took 55 s)
    assert "did not join it within" not in out and max(r["step_seconds"] for r in rows) < 20, \
        [round(r["step_seconds"], 1) for r in rows]
    fault_record["observed"] = (f"rollout 0 killed while generating; {int(last['groups_dropped'])} groups in flight "
                                f"dropped; restarted, it continued after its predecessor's "
                                f"{resumed[0].split('resuming after ')[1]} and sent {int(contributed)} groups "
                                f"in the next {len(rows) - first - 1} steps")
    fault_record["lost"] = "the groups rollout 0 was generating when killed (counted as groups_dropped)"


@pytest.mark.fault(kind="rollout fault", name="kill -9 of the only rollout worker in a weight sync, restarted")
def test_the_only_worker_killed_in_a_weight_sync_is_restarted_and_the_run_completes(tmp_path, fault_record):
    """The only rollout worker SIGKILLed in a weight sync, with restarts: the trainer waits for its restart, the new process gets the current weights again, and the run completes its steps."""
    run_dir, steps = tmp_path / "run", 6
    code, out = _launch(run_dir, "kill:0:sync:2", "cluster.rollout_restarts=1", f"loop.steps={steps}")
    assert (run_dir / "fault_fired_rollout0").exists(), out[-3000:]
    assert code == 0, out[-3000:]
    rows = _rows(run_dir)
    assert len(rows) == steps
    assert len(_loss_lines(out, 0)) == 1 and "every rollout worker is gone" not in out
    first = next(i for i, r in enumerate(rows) if r["worker_restarts"] == 1)
    assert first < steps - 1, rows
    assert sum(r["groups_received_w0"] for r in rows[first + 1:]) > 0  # only the new process can make them
    fault_record["observed"] = (f"killed in its second weight sync; restarted, it took the weights offered again "
                                f"and made the groups of steps {first + 1}..{steps - 1}; {steps} of {steps} steps done")
    fault_record["lost"] = "nothing but time (the restart)"


@pytest.mark.fault(kind="rollout fault", name="kill -9 of every rollout worker")
def test_killing_every_worker_ends_the_run_naming_each(tmp_path, fault_record):
    """Both rollout workers SIGKILLed, no restarts: the run ends non-zero at once, one line naming each worker and how it died, after a checkpoint."""
    run_dir = tmp_path / "run"
    start = time.monotonic()
    code, out = _launch(run_dir, "kill:0,1:generate:2", "cluster.rollout_workers=2", "cluster.rollout_restarts=0",
                        "loop.steps=2000")
    seconds = time.monotonic() - start
    assert code == 128 + signal.SIGKILL, out[-3000:]
    last = [line for line in out.splitlines() if "run failed" in line][-1]
    assert ("no rollout worker left: rollout 0 exited with code -9 (SIGKILL); "
            "rollout 1 exited with code -9 (SIGKILL)") in last, last
    assert list((run_dir / "checkpoints").glob("step_*")), "no checkpoint before the run ended"
    assert seconds < 300, seconds
    fault_record["observed"] = f"exit {code} in {seconds:.0f} s: {last.split('run failed ', 1)[1][:200]}"
    fault_record["lost"] = "the groups both workers were generating; the steps since the checkpoint: none"


def _freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped(task: Path) -> bool:
        try:
            return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except (OSError, IndexError):
            return True  # the thread is gone
    wait_for(lambda: all(stopped(t) for t in Path(f"/proc/{pid}/task").iterdir()), 10, f"pid {pid} stopped")


@pytest.mark.fault(kind="rollout fault", name="rollout 0 of 2 frozen past the heartbeat timeout, then thawed")
def test_a_worker_thawed_after_it_was_declared_lost_cannot_loosen_the_bound(tmp_path, fault_record):
    """Rollout 0 of 2 SIGSTOPped with a batch in flight until declared lost, SIGCONTed once the trainer moved on: its starts are given back, the groups it then sends are refused and counted, it goes on as a new generation, and no group staler than max_staleness is trained."""
    eta, gps, steps, hb_timeout = 1, 2, 24, 4.0  # steps: room for its return on a loaded machine
    sc = Scenario(out=tmp_path, workers=2, steps=steps, gps=gps, eta=eta, secret="run-secret",
                  trainer_args=["--refuse-stale", "1"],
                  worker_args={0: ["--batch", "2", "--stall-at", "1", "--stall-s", "1"], 1: ["--batch", "2"]})
    procs = sc.launch()
    pid = 0
    try:
        wait_for(lambda: (tmp_path / "stalling0.json").exists(), 120, "rollout 0's first batch in flight")
        pid = procs.procs["worker0"].pid
        _freeze(pid)
        frozen_at = len(sc.records("sync0.jsonl"))  # versions published when it froze
        wait_for(lambda: any(r["role"] == "rollout" and r["rank"] == 0 for r in sc.records("losses.jsonl")),
                 hb_timeout + 30, "rollout 0 declared lost")
        wait_for(lambda: len(sc.records("sync0.jsonl")) >= frozen_at + eta + 2, 90,
                 f"the trainer {eta + 2} versions further, on rollout 1 alone")
        thawed_at = len(sc.records("sync0.jsonl"))
        os.kill(pid, signal.SIGCONT)
        assert procs.wait("trainer0", 120) == 0, procs.logs()
        codes = [procs.wait(f"worker{w}", 30) for w in range(2)]
    finally:
        if pid and procs.procs["worker0"].poll() is None:
            os.kill(pid, signal.SIGCONT)
        procs.close()
    assert codes == [0, 0], procs.logs()
    assert thawed_at <= steps - 4, thawed_at  # its held groups reached the trainer while it still trained
    loss = next(r for r in sc.records("losses.jsonl") if r["role"] == "rollout" and r["rank"] == 0)
    done = sc.records("done.jsonl")[0]
    trained = [r for r in sc.records("hub0.jsonl") if r["step"] <= steps]  # later: the drain after the stop
    ages = [r["step"] - 1 - r["min_token_version"] for r in trained]  # step s trains at version s - 1
    assert len(trained) == steps * gps and max(ages) <= eta, sorted(ages)
    # the batch it was generating (and one not yet at the hub, if any): their starts given back,
    # and each of those groups, sent once it thawed, refused at the hub: none trained, none uncounted
    assert loss["released"] == done["fenced"] >= 2, (loss, done)
    worker0 = (tmp_path / "worker0.log").read_text()
    assert "going on as generation 2" in worker0, worker0[-3000:]
    back = [(r["step"], r["worker"]) for r in trained if r["step"] > loss["step"]]
    assert any(w == 0 for _, w in back), (thawed_at, back)  # and it contributes again
    fault_record["observed"] = (f"rollout 0 frozen with a batch in flight at version {frozen_at}, declared lost "
                                f"({loss['released']} starts given back), thawed {eta + 2} versions later: its "
                                f"{done['fenced']} groups refused at the hub (fenced), {done['stale']} refused over "
                                f"the bound; it went on as "
                                f"generation 2; the {len(trained)} groups trained were at most {max(ages)} "
                                f"versions old (max_staleness {eta})")
    fault_record["lost"] = "the groups it held when declared lost, counted as dropped and as fenced"
