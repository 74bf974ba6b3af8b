"""The main job as users run it, on the GPU machine: ``python -m launch.train`` with defaults.

One GPU: ``cluster=local`` puts the trainer and the rollout worker on GPU 0, and weights must
reach the worker by CUDA IPC (NCCL refuses two ranks on one device). Two GPUs: ``cluster=gpu2``,
weights over an NCCL broadcast. Each run must finish its steps with the published version
advancing one per step and the worker holding the last version. On two GPUs again with what a
verl user turns on: the entropy bonus and the KL to the initial policy (the bf16 entropy and
reference passes on the GPU) and held-out points while training (on the engine's GPU).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _run(run_dir: Path, *overrides: str) -> str:
    cmd = [sys.executable, "-m", "launch.train", f"loop.run_dir={run_dir}", f"loop.steps={STEPS}",
           "loop.progress_bar=false", "loop.receive_timeout_s=300", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _check_run(run_dir: Path, out: str) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") != "heldout"]  # training steps (held-out points: eval.*)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["version"] for r in rows] == [float(s + 1) for s in range(STEPS)]
    # a step logs the last sync that finished (published from a thread): none yet at step 0
    assert rows[-1]["weight_sync_seconds"] > 0 and all(r["weight_sync_seconds"] >= 0 for r in rows)
    worker_log = (run_dir / "logs" / "rollout0.log").read_text()
    assert f"last weights version loaded {STEPS}" in worker_log, worker_log[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    sync = [r["weight_sync_seconds"] for r in rows]
    print(f"steps {STEPS}: weight_sync_seconds {['%.4f' % s for s in sync]}, "
          f"step_seconds {['%.2f' % r['step_seconds'] for r in rows]}, wall {summary['wall_seconds']:.1f} s")
    return rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_main_job_defaults_on_one_gpu_uses_cuda_ipc(tmp_path):
    out = _run(tmp_path, "transport.control.port=0", "cluster.master_port=0",
               "cluster.trainer_devices=[0]", "cluster.rollout_devices=[0]")
    assert "weight sync stage 0: CUDA IPC to [0]" in out, out[-4000:]
    assert "Duplicate GPU" not in out
    _check_run(tmp_path, out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_main_job_on_two_gpus_uses_nccl(tmp_path):
    out = _run(tmp_path, "cluster=gpu2", "transport.control.port=0", "cluster.master_port=0")
    assert "weight sync stage 0: nccl broadcast to [0]" in out, out[-4000:]
    _check_run(tmp_path, out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_main_job_on_two_gpus_with_entropy_kl_and_validation(tmp_path):
    out = _run(tmp_path, "cluster=gpu2", "transport.control.port=0", "cluster.master_port=0",
               "algorithm.entropy_coef=0.001", "algorithm.kl_coef=0.001", "algorithm.kl_estimator=k3",
               "eval.benchmarks=[heldout]", "eval.every_n_steps=2", "eval.limit=32")
    rows = _check_run(tmp_path, out)
    for r in rows:
        assert 0 < r["entropy"] < 20 and math.isfinite(r["loss"]), r
        assert r["kl_ref"] >= -1e-6 and r["ref_rows"] >= 1, r  # k3 >= 0 up to float32 rounding of exp
    assert abs(rows[0]["kl_ref"]) < 1e-6 < rows[-1]["kl_ref"]  # version 0 is the reference (GPU: -3.9e-10)
    points = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    points = [p for p in points if p.get("kind") == "heldout"]
    assert sorted(p["version"] for p in points) == list(range(0, STEPS + 1, 2))
    assert all(0.0 <= p["heldout/builtin/avg@1"] <= 1.0 and p["heldout/builtin/prompts"] == 32 for p in points)
