"""The main job stopped by its run dir's stop request alone (no signal reaches any process): the
trainer ends after its current step with a checkpoint, the launcher says how to go on, the
request is gone; a resumed launch that finds a stale request clears it and trains to the end."""

import json
import os
import subprocess
import sys
import time

from megatron_darl.loop.stop_request import request_path
from tests.distributed.test_loop_smoke import REPO, run_smoke


def test_a_stop_request_checkpoints_and_the_resumed_launch_ignores_a_stale_one(tmp_path):
    cmd = [sys.executable, "-m", "launch.train", "experiment=smoke", f"loop.run_dir={tmp_path}",
           "transport.control.port=0", "cluster.master_port=0", "loop.steps=500"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    request_path(tmp_path).write_text("")  # what `touch <run_dir>/stop_request` leaves
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert saved, out[-3000:]
    stopped_at = int(saved[-1].name.split("_")[1])
    assert 2 <= stopped_at < 500
    assert f"stopped: {stopped_at} of 500 steps" in out and "loop.resume=true" in out, out[-2000:]
    assert "asks for a stop (SIGUSR1)" in out + "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert not request_path(tmp_path).exists()  # done: the next launch starts clean

    request_path(tmp_path).write_text("SIGTERM\n")  # left over: it was for the launch above
    total = stopped_at + 2
    again = run_smoke(tmp_path, "loop.resume=true", steps=total)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"done: {total} steps" in again.stdout
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(total))
