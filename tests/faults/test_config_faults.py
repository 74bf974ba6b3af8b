"""Mistakes in a run's config that used to surface late: each must stop the launcher at once.

``launch.train.main`` runs in-process with the bad override: exit code 2, one line naming the
field on stderr, and nothing started (no ``run_config.yaml`` is written, no child exists).
"""

from __future__ import annotations

import json

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
    # without the launcher's checks these fail inside the children (39-79 lines of traceback, or
    # "trainer gone?") or train with no learning signal
    "lr not a number": (["trainer.optimizer.lr=nan"], "trainer.optimizer.lr=nan is not a number"),
    "lr far too large": (["trainer.optimizer.lr=1e9"], "trainer.optimizer.lr=1e+09 must be in (0, 1)"),
    "no prompts generated": (["data.builtin.num_prompts=0"], "data.builtin.num_prompts=0 must be >= cluster.rollout_workers=1"),
    "rendezvous port out of range": (["cluster.master_port=99999"], "cluster.master_port=99999 must be in [0, 65535]"),
    "greedy sampling (no learning signal)": (["sampling.temperature=0"], "sampling.temperature=0.0: greedy decoding"),
    "groups of one response (no learning signal)": (["algorithm.group_size=1"], "algorithm.group_size=1: a group of one"),
    # these trained: root binds port 1; the weights went uncapped; max_records was ignored
    "privileged control port": (["transport.control.port=1"], "transport.control.port=1 is a privileged port"),
    "uncapped importance weights": (["algorithm.mis.clip=inf"], "algorithm.mis.clip=inf: the behavior weights"),
    "max_records keeping no prompts": (["data.max_records=0"], "data.max_records=0 keeps no prompts"),
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


@pytest.mark.fault(kind="config", name="resume with another model size")
def test_a_resume_with_another_model_is_refused_before_launch(tmp_path, capsys, fault_record):
    """A resume whose model differs from the checkpoint's exits 2 in one line naming the field, before the warm start, and leaves run_config.yaml as it was."""
    from megatron_darl.checkpoint.model_io import CheckpointMetadata, write_metadata

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    spec = {"hidden_size": 128, "intermediate_size": 384, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
            "head_dim": 32, "max_position_embeddings": 256, "tie_word_embeddings": True, "vocab_size": 100}
    write_metadata(ckpt, CheckpointMetadata(hf_config={}, padded_vocab_size=128, dtype="float32", saved_tp=1,
                                            saved_pp=1, model_spec=spec, extra={"trainer": {"step": 2}}))
    (ckpt / "metadata.json").write_text("{}")
    old_config = "# the checkpoint's run\nloop:\n  steps: 2\n"
    (run_dir / "run_config.yaml").write_text(old_config)
    code = train.main([f"loop.run_dir={run_dir}", "loop.resume=true", "loop.steps=4",
                       "warmstart.model.intermediate_size=96", "warmstart.model.hidden_size=128",
                       "warmstart.model.num_hidden_layers=4"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, (code, err)
    assert f"loop.resume: {ckpt} holds another model" in err[0] and "intermediate_size: checkpoint 384 vs 96" in err[0]
    assert (run_dir / "run_config.yaml").read_text() == old_config
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "run.lock", "run_config.yaml"]
    fault_record["observed"] = err[0][:200]
