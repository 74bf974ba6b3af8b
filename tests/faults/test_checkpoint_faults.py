"""Damaged checkpoints under the main job's resume: refused in one line naming the file, never loaded.

A real run (``python -m launch.train``, ``experiment=smoke``) writes its checkpoints (the periodic
one after step 1, the final one after step 2); a copy of its run dir gets the damage a disk, a
copy or a bad write leaves in the newest checkpoint, and ``loop.resume=true`` must refuse it:
zeros or 0xFF bytes inside a tensor of a ``.distcp`` shard (before checksums these resumed a
zeroed model silently, or NaN weights that only the rollout worker noticed, as a "control-plane
store failed"), a garbage ``common.pt`` (a bare ``UnicodeDecodeError``), and 0xFF bytes in a
checkpoint without checksums (one written before they were kept), where the NaN weights
themselves are found after the load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _launch(run_dir: Path, *overrides: str, timeout: float = 600) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "launch.train", "experiment=smoke", f"loop.run_dir={run_dir}",
           "transport.control.port=0", "cluster.master_port=0", "cluster.grace_s=10", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A two-step run: checkpoints after step 1 (periodic) and step 2 (final)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    code, out = _launch(run, "loop.steps=2")
    assert code == 0, out[-3000:]
    return run


def _tensor_bytes(ckpt: Path, prefix: str) -> tuple[Path, int, int]:
    """(shard file, offset, length) of the first stored item of the model tensor ``prefix``."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(ckpt)).read_metadata().storage_data
    _, info = min(((k, v) for k, v in storage.items() if k.fqn == prefix), key=lambda kv: kv[1].offset)
    return ckpt / info.relative_path, info.offset, info.length


def _overwrite(ckpt: Path, byte: int) -> str:
    """``byte`` over 4 KiB in the middle of an MLP weight's stored bytes; returns the shard's name."""
    shard, offset, length = _tensor_bytes(ckpt, "decoder.layers.mlp.linear_fc2.weight")
    with open(shard, "r+b") as f:
        f.seek(offset + length // 2)
        f.write(bytes([byte]) * 4096)
    return shard.name


def _garbage_common(ckpt: Path) -> str:
    common = ckpt / "common.pt"
    size = common.stat().st_size
    common.write_bytes((bytes(range(128, 256)) * (size // 128 + 1))[:size])  # not UTF-8, not a pickle
    return common.name


DAMAGE = {  # name -> (damage the checkpoint and return the file, what the line must say)
    "0xFF in a shard": (lambda c: _overwrite(c, 0xFF), "does not match its checksum"),
    "0xFF in a shard, no checksums": (lambda c: (c / "checksums.json").unlink(missing_ok=True) or _overwrite(c, 0xFF),
                                      "values are nan) after loading"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.fault(kind="file", name="damaged bytes in the newest checkpoint (resume)")
def test_a_damaged_checkpoint_is_refused_naming_the_file(trained_run, tmp_path, damage, fault_record):
    """Resume refuses the newest checkpoint in one line naming it, the damaged file (or weight) and the previous checkpoint; nothing is trained from it."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest, previous = run / "checkpoints" / "step_000002", run / "checkpoints" / "step_000001"
    apply, says = DAMAGE[damage]
    what = apply(newest)
    code, out = _launch(run, "loop.resume=true", "loop.steps=4")
    assert code == 1, out[-3000:]
    verdict = [line for line in out.splitlines() if "run failed" in line]
    assert verdict, out[-3000:]
    line = verdict[-1]
    assert f"checkpoint {newest} is damaged: " in line and says in line, line
    assert f"the previous checkpoint is {previous}" in line, line
    if "no checksums" in damage:
        assert "weight model0.decoder.layers." in line and "mlp.linear_fc2.weight" in line, line
    else:
        assert f"{newest / what} " in line, line
    assert "Traceback" not in out, out[-3000:]
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2  # nothing trained from the damaged state
    fault_record["observed"] = line.split("run failed (exit 1): ")[-1].split("; the previous checkpoint")[0][:300]
    fault_record["lost"] = "the steps after the previous checkpoint (the damaged one is kept for inspection)"


@pytest.mark.fault(kind="file", name="zeros in a shard, garbage common.pt (checked before any parse)")
def test_zeros_in_a_shard_and_a_garbage_common_pt_fail_their_checksums(trained_run, tmp_path, fault_record):
    """The load's first check names the damaged file of each (the same check as the resume above, on every rank); the undamaged checkpoint passes."""
    from megatron_darl.checkpoint.checksums import verify_checkpoint

    root = tmp_path / "checkpoints"
    shutil.copytree(trained_run / "checkpoints", root)
    assert verify_checkpoint(root / "step_000002") == ""
    zeros, common = root / "step_000002", root / "step_000001"
    shard = _overwrite(zeros, 0x00)
    assert verify_checkpoint(zeros).startswith(f"{zeros / shard} does not match its checksum")
    _garbage_common(common)
    assert verify_checkpoint(common).startswith(f"{common / 'common.pt'} does not match its checksum")
    fault_record["observed"] = ("zeros over 4 KiB of a weight in __0_*.distcp and a non-UTF-8 common.pt of the "
                                "same size: each named by its checksum before anything parses it")
    fault_record["lost"] = "that checkpoint (resume offers the previous one, as above)"


def _damage_embedding(ckpt: Path, byte: int, checksums: bool = True) -> Path:
    """``byte`` over 4 KiB in the middle of the embedding's stored bytes (same size); the shard."""
    shard, offset, length = _tensor_bytes(ckpt, "embedding.word_embeddings.weight")
    with open(shard, "r+b") as f:
        f.seek(offset + length // 2)
        f.write(bytes([byte]) * 4096)
    if not checksums:
        (ckpt / "checksums.json").unlink()
    return shard


def _init_from(rank: int, world: int, ckpt: str, out: str) -> None:
    """Gloo worker: a ``PolicyTrainer`` with ``init_checkpoint=ckpt``; writes what it raised."""
    from megatron_darl.checkpoint.model_io import CheckpointDamaged, read_metadata
    from megatron_darl.trainer.config import TrainerConfig
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    ps = init_parallel(ParallelConfig(timeout_s=120))
    try:
        PolicyTrainer(TrainerConfig(bf16=False, init_checkpoint=ckpt), ps, read_metadata(ckpt).hf_config)
        Path(out).write_text("loaded")
    except CheckpointDamaged as exc:
        Path(out).write_text(str(exc))


@pytest.mark.fault(kind="file", name="zeros or 0xFF in a checkpoint's embedding, loaded by the tools")
def test_every_tool_that_loads_weights_refuses_a_damaged_checkpoint(trained_run, tmp_path, capsys, fault_record):
    """The converter, eval and trainer.init_checkpoint refuse 4 KiB of zeros or 0xFF in the embedding bytes in one line naming the file (by checksum before parsing; by NaN after loading where no checksums exist); nothing is written."""
    from megatron_darl.checkpoint.hf_dir import resolve_hf_dir
    from megatron_darl.checkpoint.model_io import CheckpointDamaged
    from megatron_darl.trainer.parallel import run_local_gloo
    from tools import convert_megatron_to_hf as to_hf

    source, lines = trained_run / "checkpoints" / "step_000002", {}
    for name, byte, sums in (("zeros", 0x00, True), ("ff", 0xFF, True), ("ff-nosums", 0xFF, False)):
        ckpt = tmp_path / name / "step_000002"
        shutil.copytree(source, ckpt)
        shard = _damage_embedding(ckpt, byte, sums)
        out = tmp_path / f"hf-{name}"
        code = to_hf.main(["--megatron-dir", str(ckpt), "--out-dir", str(out), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and not out.exists(), err
        line = lines[name] = err[-1]
        assert line.startswith(f"convert_megatron_to_hf: error: checkpoint {ckpt} is damaged: "), line
        if sums:
            assert f"{shard} does not match its checksum" in line and len(err) == 1, err
        else:  # the bytes carry no checksums: the NaN they decode to is found after the load
            assert "weight embedding.word_embeddings.weight (1024 of " in line and "values are nan" in line, line
    with pytest.raises(CheckpointDamaged) as refused:  # tools/eval.py's loader: through the converter
        resolve_hf_dir(tmp_path / "zeros" / "step_000002", tmp_path / "eval", REPO / "tools" / "convert_megatron_to_hf.py")
    said = str(refused.value)
    assert "\n" not in said and f"{tmp_path / 'zeros' / 'step_000002' / shard.name} does not match" in said, said
    result = tmp_path / "init.txt"
    run_local_gloo(_init_from, 1, args=(str(tmp_path / "ff" / "step_000002"), str(result)), timeout_s=300)
    assert result.read_text().startswith(f"checkpoint {tmp_path / 'ff' / 'step_000002'} is damaged: "
                                         f"{tmp_path / 'ff' / 'step_000002' / shard.name} does not match its checksum")
    fault_record["observed"] = (f"converter, eval (--model) and trainer.init_checkpoint each refused the checkpoint "
                                f"in one line naming {shard.name}; without checksums.json the converter named "
                                "the embedding's 1024 NaN values after loading")
    fault_record["lost"] = "nothing: no HF model, no score and no training came from the damaged weights"
