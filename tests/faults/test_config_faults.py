"""Mistakes in a run's config that used to surface late: each must stop the launcher at once.

``launch.train.main`` runs in-process with the bad override: exit code 2, one line naming the
field on stderr, and nothing started (no ``run_config.yaml`` is written, no child exists).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import train

CASES = {
    "negative max_new_tokens": (["sampling.max_new_tokens=-1"], "sampling.max_new_tokens=-1"),
    "top_p out of range": (["sampling.top_p=1.5"], "sampling.top_p=1.5"),
    "unknown reward task": (["data.task=nosuch"], "data.task='nosuch'"),
    "tp not dividing the heads": (["parallel.tp=3", "cluster.trainer_ranks=3"], "parallel.tp=3 does not divide"),
    "pp not dividing the layers": (["parallel.pp=3", "cluster.trainer_ranks=3"], "parallel.pp=3 does not divide"),
    "engine TP not dividing the heads": (["engine.tensor_parallel_size=3"], "engine.tensor_parallel_size=3"),
    "responses longer than the model's context": (["sampling.max_new_tokens=4000"], "max_position_embeddings=256"),
    "model.path that does not exist": (["model.path=/nonexistent"], "model.path=/nonexistent: no such directory"),
    "dataset file that does not exist": (["data=gsm8k", "data.path=/nonexistent.jsonl"], "data.path=/nonexistent.jsonl"),
    "model of another architecture": (["model.path={llama}"], "LlamaForCausalLM is not supported"),
    # issue 31: these used to fail inside the children (39-79 lines of traceback, or "trainer
    # gone?") or train with no learning signal
    "lr not a number": (["trainer.optimizer.lr=nan"], "trainer.optimizer.lr=nan is not a number"),
    "lr far too large": (["trainer.optimizer.lr=1e9"], "trainer.optimizer.lr=1e+09 must be in (0, 1)"),
    "no prompts generated": (["data.builtin.num_prompts=0"], "data.builtin.num_prompts=0 must be >= cluster.rollout_workers=1"),
    "rendezvous port out of range": (["cluster.master_port=99999"], "cluster.master_port=99999 must be in [0, 65535]"),
    "greedy sampling (no learning signal)": (["sampling.temperature=0"], "sampling.temperature=0.0: greedy decoding"),
    "groups of one response (no learning signal)": (["algorithm.group_size=1"], "algorithm.group_size=1: a group of one"),
}


@pytest.mark.fault(kind="config", name="late config errors")
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_value_stops_the_launcher_with_one_line(tmp_path, capsys, case, fault_record):
    """The launcher exits 2 with one line naming the field before any process starts."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    overrides, needle = CASES[case]
    run_dir = tmp_path / "run"
    # a short receive timeout: a case the launcher lets through fails in seconds, not in 10 minutes
    args = [f"loop.run_dir={run_dir}", "loop.steps=2", "loop.receive_timeout_s=30"] + [o.format(llama=llama) for o in overrides]
    try:
        code = train.main(args)
    except SystemExit as exc:  # a composition error leaves through _load
        code = exc.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("(see")]
    assert code == 2 and len(err) == 1 and needle in err[0], (code, err)
    assert "Traceback" not in err[0] and not (run_dir / "run_config.yaml").exists()
    fault_record["observed"] = err[0][:200]
