"""The local process launcher with trivial children: failures named by role/rank, nothing left.

Children are tiny Python scripts that write their pids (and those of grandchildren they start)
to files, so the test can check that every process of every tree is gone afterwards.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

from launch.procs import ROLLOUT, TRAINER, Launcher, ProcSpec
from megatron_darl.loop.stop_request import write_request


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def child(tmp: Path, role: str, rank: int, body: str) -> ProcSpec:
    """A child that records its pid, starts a sleeping grandchild (same session), then ``body``."""
    code = (
        "import os, subprocess, sys, time, signal\n"
        # whole or absent: a reader between open() and write() would find an empty pid file
        "def put(path, text):\n"
        "    open(path + '.tmp', 'w').write(text)\n"
        "    os.replace(path + '.tmp', path)\n"
        f"put({str(tmp / f'{role}{rank}.pid')!r}, str(os.getpid()))\n"
        "g = subprocess.Popen(['sleep', '300'])\n"
        f"put({str(tmp / f'{role}{rank}.grand')!r}, str(g.pid))\n"
        + body
    )
    return ProcSpec(role, rank, [sys.executable, "-c", code], dict(os.environ),
                    log_path=tmp / "logs" / f"{role}{rank}.log")


def wait_all(tmp: Path, n: int) -> str:
    """Child code: block until all ``n`` pid files exist (every tree started) before going on."""
    return (f"import glob\nwhile len(glob.glob({str(tmp)!r} + '/*.pid') + glob.glob({str(tmp)!r} + '/*.grand')) < {n}:\n"
            "    time.sleep(0.05)\n")


def all_pids(tmp: Path) -> list[int]:
    return [int(p.read_text()) for p in list(tmp.glob("*.pid")) + list(tmp.glob("*.grand"))]


def wait_for_pids(tmp: Path, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(all_pids(tmp)) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def test_success_then_workers_stopped(tmp_path):
    specs = [child(tmp_path, TRAINER, r, wait_all(tmp_path, 6)) for r in range(2)]
    specs.append(child(tmp_path, ROLLOUT, 0, "time.sleep(300)\n"))
    result = Launcher(specs, grace_s=1.0).run()
    assert result.code == 0 and result.failures == []
    assert len(all_pids(tmp_path)) == 6 and not any(alive(p) for p in all_pids(tmp_path))


def test_failing_trainer_is_named_and_everything_dies(tmp_path):
    specs = [
        child(tmp_path, TRAINER, 0, "time.sleep(300)\n"),
        child(tmp_path, TRAINER, 1, wait_all(tmp_path, 6) + "print('boom: rank 1 broke', flush=True)\nsys.exit(3)\n"),
        child(tmp_path, ROLLOUT, 0, "time.sleep(300)\n"),
    ]
    result = Launcher(specs, grace_s=1.0).run()
    assert result.code == 3
    assert len(result.failures) == 1 and result.failures[0].startswith("trainer 1 exited with code 3")
    assert "boom: rank 1 broke" in result.failures[0]  # the log tail names the cause
    assert len(all_pids(tmp_path)) == 6 and not any(alive(p) for p in all_pids(tmp_path))


def test_dead_rollout_worker_reported_and_run_goes_on(tmp_path):
    specs = [
        child(tmp_path, TRAINER, 0, wait_all(tmp_path, 6) + "time.sleep(1.0)\n"),
        child(tmp_path, ROLLOUT, 0, wait_all(tmp_path, 6) + "sys.exit(7)\n"),
        child(tmp_path, ROLLOUT, 1, "time.sleep(300)\n"),
    ]
    result = Launcher(specs, grace_s=1.0).run()
    assert result.code == 0 and result.failures[0].startswith("rollout 0 exited with code 7")
    assert not any(alive(p) for p in all_pids(tmp_path))
    abort = Launcher([child(tmp_path / "b", TRAINER, 0, "time.sleep(300)\n"),
                      child(tmp_path / "b", ROLLOUT, 0, "sys.exit(7)\n")], grace_s=1.0).run()
    assert abort.code == 7 and abort.failures[0] == "no rollout worker left: rollout 0 exited with code 7"
    assert not any(alive(p) for p in all_pids(tmp_path / "b"))


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def signal_once_up(tmp: Path, pids: int, ready: Path, signum: int) -> None:
    """Send ``signum`` to this process once ``pids`` pid files and ``ready`` exist (each wait
    bounded): sent in any case, so a failed wait cannot leave the launcher waiting."""
    try:
        wait_for_pids(tmp, pids)
        wait_for_file(ready)
    finally:
        os.kill(os.getpid(), signum)


def test_sigterm_is_forwarded_and_children_can_clean_up(tmp_path):
    flag, ready = tmp_path / "trainer0.got_term", tmp_path / "trainer0.ready"
    trap = (
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(flag)!r}, 'w').write('x'), sys.exit(0)))\n"
        f"open({str(ready)!r}, 'w').write('x')\n"  # the handler is in place: the signal may come
        "time.sleep(300)\n"
    )
    specs = [child(tmp_path, TRAINER, 0, trap), child(tmp_path, ROLLOUT, 0, "time.sleep(300)\n")]
    timer = threading.Thread(target=signal_once_up, args=(tmp_path, 4, ready, signal.SIGTERM))
    timer.start()
    result = Launcher(specs, grace_s=5.0).run()
    timer.join()
    assert result.code == 128 + signal.SIGTERM and result.signal == signal.SIGTERM
    assert flag.exists()  # the trainer saw SIGTERM (it would checkpoint here)
    assert not any(alive(p) for p in all_pids(tmp_path))


def test_a_stop_signal_the_trainer_never_sees_still_reaches_it_through_the_stop_request(tmp_path):
    """A trainer whose SIGUSR1 is taken over below Python (here: ignored, as a native library's
    handler that passes nothing on) still stops: the launcher writes the signal into the run
    dir's stop request before it forwards it, and the trainer reads that file."""
    seen, ready = tmp_path / "trainer0.stop_seen", tmp_path / "trainer0.ready"
    trainer = (
        "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').write('x')\n"
        "from megatron_darl.loop.stop_request import read_request, request_path\n"
        f"while read_request(request_path({str(tmp_path)!r})) is None:\n"
        "    time.sleep(0.05)\n"
        f"open({str(seen)!r}, 'w').write(str(int(read_request(request_path({str(tmp_path)!r})))))\n"
    )
    specs = [child(tmp_path, TRAINER, 0, trainer), child(tmp_path, ROLLOUT, 0, "time.sleep(300)\n")]
    specs[0].env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    timer = threading.Thread(target=signal_once_up, args=(tmp_path, 4, ready, signal.SIGUSR1))
    timer.start()
    start = time.monotonic()
    result = Launcher(specs, grace_s=20.0, on_stop=lambda signum: write_request(tmp_path, signum)).run()
    timer.join()
    assert result.code == 128 + signal.SIGUSR1
    assert seen.read_text() == str(int(signal.SIGUSR1))  # the trainer stopped on the request
    assert time.monotonic() - start < 15  # it left on its own, not at the grace's SIGKILL
    assert not any(alive(p) for p in all_pids(tmp_path))


def test_a_worker_killed_by_a_signal_is_restarted_within_its_budget_and_one_that_said_why_is_not(tmp_path):
    """Rollout 0 SIGKILLs itself twice (restarts 1: started again once, then gone); rollout 1 exits
    4 after writing why (not restarted). The run is told of the restart first, and the second
    process's log follows the first's."""
    runs = tmp_path / "rollout0.runs"
    reason = tmp_path / "rollout1.exit"
    kill_self = (f"open({str(runs)!r}, 'a').write('run\\n')\n"
                 "os.kill(os.getpid(), signal.SIGKILL)\n")
    say_why = f"open({str(reason)!r}, 'w').write('rollout 1: the engine could not load the weights\\n')\nsys.exit(4)\n"
    specs = [child(tmp_path, TRAINER, 0, "time.sleep(300)\n"),
             child(tmp_path, ROLLOUT, 0, kill_self), child(tmp_path, ROLLOUT, 1, say_why)]
    specs[2].reason_path = reason
    told: list[tuple[str, int]] = []
    launcher = Launcher(specs, grace_s=1.0, rollout_restarts=1, on_restart=lambda spec, n: told.append((spec.name, n)))
    result = launcher.run()
    assert runs.read_text().count("run") == 2 and told == [("rollout 0", 1)] and launcher.restarts == {0: 1}
    assert result.failures[0] == ("no rollout worker left: rollout 0 exited with code -9 (SIGKILL); "
                                  "rollout 1 exited with code 4: rollout 1: the engine could not load the weights")
    assert any(f.startswith("rollout 0 exited with code -9 (SIGKILL) (restarting it: restart 1 of 1)")
               for f in result.failures)
    assert result.code in (128 + signal.SIGKILL, 4)  # the code of whichever left last
    assert not any(alive(p) for p in all_pids(tmp_path))
