"""Weight sync from a real TP2xPP2 Megatron trainer to rollout workers, bitwise.

Three process trees, started as separate Slurm job steps would be, meet only through the
control-plane store: the trainer step (``procs/megatron_sender.py``: four gloo ranks holding a
``PolicyTrainer`` of a tiny Qwen3 with untied embeddings and a vocab of 300, padded to 384 rows
inside Megatron) and two rollout workers (``procs/worker_proc.py``: the real ``hf``
engine). The trainer takes one Adam step, so version 1 differs from the checkpoint the workers
start from in every tensor; each PP stage's TP-0 leader streams ``export_hf_stage`` (TP gathers,
vocab padding stripped, q/k/v and gate/up unfused) through ``WeightSender``. Every worker must end
up holding exactly what the leaders streamed, and the store must say version 1, acked by both.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from tests.distributed.procs.launcher import Procs, free_port, wait_for
from tests.distributed.procs.qwen3_tiny import VOCAB, make_tiny_hf

WORKERS = 2
TIMEOUT_S = 60  # every store wait and collective inside the processes
EXIT_S = 150  # how long the test waits for each process tree to finish


def _session_alive(pid: int) -> bool:
    """Whether any process is left in the session (process group) started as ``pid``."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _launch(tmp_path, model_dir) -> Procs:
    port, dist_port = free_port(), free_port()
    common = ["--port", str(port), "--workers", str(WORKERS), "--out", str(tmp_path), "--model-dir", str(model_dir),
              "--hb-timeout", "20", "--join-timeout", "30", "--timeout", str(TIMEOUT_S)]
    procs = Procs(tmp_path)
    procs.start("trainer", "tests.distributed.procs.megatron_sender", *common, "--dist-port", str(dist_port),
                "--tp", "2", "--pp", "2", "--train-steps", "1", "--deadline", str(EXIT_S - 10))
    for w in range(WORKERS):  # gps 1, eta 0: one group at v0, then wait for v1
        procs.start(f"worker{w}", "tests.distributed.procs.worker_proc", *common, "--worker", str(w),
                    "--stages", "2", "--hubs", "1", "--gps", "1", "--eta", "0")
    return procs


def test_tp2pp2_export_reaches_every_worker_bitwise_and_acked(tmp_path):
    model_dir = tmp_path / "model"
    make_tiny_hf(model_dir, tie=False)
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" in checkpoint  # untied: the LM head travels too
    procs = _launch(tmp_path, model_dir)
    try:
        names = ["trainer"] + [f"worker{w}" for w in range(WORKERS)]
        codes = {name: procs.wait(name, EXIT_S) for name in names}
        assert codes == dict.fromkeys(names, 0), procs.logs()
        wait_for(lambda: not any(_session_alive(p.pid) for p in procs.procs.values()), 10,
                 "every process of the three job steps to be gone")
    finally:
        procs.close()

    stages = [torch.load(tmp_path / f"export{s}.pt") for s in range(2)]
    assert not set(stages[0]) & set(stages[1])
    export = {**stages[0], **stages[1]}
    assert set(export) == set(checkpoint)
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"} <= set(stages[0])
    assert {"lm_head.weight", "model.norm.weight", "model.layers.3.mlp.up_proj.weight"} <= set(stages[1])
    for name, tensor in export.items():  # HF shapes (padding stripped), and the Adam step moved it
        assert tensor.shape == checkpoint[name].shape and tensor.dtype == checkpoint[name].dtype, name
        assert not torch.equal(tensor, checkpoint[name]), f"{name}: export equals the checkpoint"
    assert export["lm_head.weight"].shape[0] == VOCAB

    for w in range(WORKERS):
        saved = torch.load(tmp_path / f"worker{w}.pt")
        assert saved["version"] == 1
        state = saved["state"]
        assert set(state) == set(export), sorted(set(state) ^ set(export))
        for name, tensor in export.items():
            assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), f"worker {w}: {name}"

    coordinator = json.loads((tmp_path / "sync0.json").read_text())
    assert coordinator["version"] == 1 and coordinator["published"]
    assert sorted(coordinator["acked"]) == [0, 1] and coordinator["missing"] == []
    assert coordinator["store_published"] == 1 and coordinator["store_acks"] == [1, 1]
    stage1 = json.loads((tmp_path / "sync1.json").read_text())
    for report in (coordinator, stage1):  # both stages reached both workers, in several buckets
        assert report["members"] == [0, 1] and report["attempts"] == 1 and report["buckets"] >= 2, report
