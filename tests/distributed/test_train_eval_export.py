"""What was trained can be evaluated and exported: train, evaluate the checkpoint, export it to HF,
load that with transformers and generate.

A real two-step run (``python -m launch.train experiment=smoke``) writes its checkpoints; one is
copied elsewhere, as a user copies a checkpoint off a cluster, and the copy alone must serve
``tools/eval.py --model <checkpoint>`` and ``tools/convert_megatron_to_hf.py``. Before
checkpoints carried the policy's tokenizer, eval ended with "prompts must hold at least one token
each" and the converter wrote an HF dir that transformers loaded with an empty tokenizer. A
checkpoint without one (saved before) is refused in one line naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_darl.checkpoint import checksums

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [("12+7=?", "19"), ("3*4=?", "12"), ("9-5=?", "4")]  # short: the tiny policy has 256 positions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The final checkpoint of a two-step run, copied out of its run dir."""
    root = tmp_path_factory.mktemp("trained")
    cmd = [sys.executable, "-m", "launch.train", "experiment=smoke", "loop.steps=2", f"loop.run_dir={root / 'run'}",
           "transport.control.port=0", "cluster.master_port=0", "cluster.grace_s=10"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    copy = root / "elsewhere" / "step_000002"
    shutil.copytree(root / "run" / "checkpoints" / "step_000002", copy)
    shutil.rmtree(root / "run")  # nothing of the run dir is left to lean on
    return copy


def _gsm8k_file(path: Path) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": f"{q[:-2]}\n#### {a}"}) + "\n"
                            for q, a in QUESTIONS))
    return path


@pytest.mark.slow
def test_a_training_checkpoint_evaluates_exports_and_generates(checkpoint, tmp_path, monkeypatch, capsys):
    """The checkpoint carries the tokenizer and HF config under its checksums; eval scores it,
    the converter exports it with the tokenizer, and transformers loads the export and generates."""
    manifest = checksums.read_manifest(checkpoint)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (checkpoint / name).is_file() and name in manifest, name
    assert checksums.verify_checkpoint(checkpoint) == ""
    meta = json.loads((checkpoint / "megatron_darl.json").read_text())
    assert json.loads((checkpoint / "config.json").read_text())["vocab_size"] == meta["hf_config"]["vocab_size"]

    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import eval as eval_tool  # tools/eval.py

    out = tmp_path / "eval"
    rc = eval_tool.main(["--model", str(checkpoint), "--benchmarks", "gsm8k", "--gsm8k-path",
                         str(_gsm8k_file(tmp_path / "gsm8k.jsonl")), "--limit", "2", "--n", "2",
                         "--max-new-tokens", "6", "--out-dir", str(out), "--device", "cpu", "--no-progress"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    result = json.loads((out / "results.json").read_text())["results"]["gsm8k"]
    assert result["num_prompts"] == 2 and result["n"] == 2 and 0 < result["mean_response_tokens"] <= 6

    from tools import convert_megatron_to_hf as to_hf

    hf_dir = tmp_path / "hf"
    assert to_hf.main(["--megatron-dir", str(checkpoint), "--out-dir", str(hf_dir), "--no-progress"]) == 0
    assert (hf_dir / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    ids = tokenizer(QUESTIONS[0][0], return_tensors="pt").input_ids
    assert ids.shape[1] == len(QUESTIONS[0][0]) + 1  # the character tokenizer plus <bos>, not empty
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > ids.shape[1] and torch.equal(generated[0, : ids.shape[1]], ids[0])
    assert isinstance(tokenizer.decode(generated[0, ids.shape[1]:]), str)


def test_a_checkpoint_without_a_tokenizer_is_refused_naming_it(checkpoint, tmp_path, monkeypatch, capsys):
    """A checkpoint saved before checkpoints carried a tokenizer: the converter and eval refuse it
    in one line naming it, and write nothing."""
    old = tmp_path / "step_000002"
    shutil.copytree(checkpoint, old)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        (old / name).unlink(missing_ok=True)
    assert checksums.write_manifest(old) == ""  # as such a checkpoint was sealed

    from tools import convert_megatron_to_hf as to_hf

    hf_dir = tmp_path / "hf"
    assert to_hf.main(["--megatron-dir", str(old), "--out-dir", str(hf_dir), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"convert_megatron_to_hf: error: checkpoint {old} has no tokenizer"), err
    assert "--tokenizer-dir" in err[0] and not hf_dir.exists()

    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import eval as eval_tool  # tools/eval.py

    rc = eval_tool.main(["--model", str(old), "--benchmarks", "gsm8k", "--gsm8k-path",
                         str(_gsm8k_file(tmp_path / "gsm8k.jsonl")), "--out-dir", str(tmp_path / "eval")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"checkpoint {old} has no tokenizer" in err[0], err


@pytest.mark.slow
def test_tokenizer_dir_exports_a_checkpoint_saved_without_one(checkpoint, tmp_path):
    """``--tokenizer-dir`` supplies the tokenizer of a checkpoint without one; the config stays
    the checkpoint's."""
    old = tmp_path / "step_000002"
    shutil.copytree(checkpoint, old)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (old / name).unlink()
    assert checksums.write_manifest(old) == ""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, source / name)
    (source / "config.json").write_text("{}")  # not the checkpoint's: must not be taken

    from tools import convert_megatron_to_hf as to_hf

    hf_dir = tmp_path / "hf"
    assert to_hf.main(["--megatron-dir", str(old), "--out-dir", str(hf_dir), "--tokenizer-dir", str(source),
                       "--no-progress"]) == 0
    assert (hf_dir / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    assert (hf_dir / "config.json").read_bytes() == (checkpoint / "config.json").read_bytes()
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(hf_dir))("1+1").input_ids) == 4
