"""Damaged and hostile run directories on resume: metrics, checkpoint shards, extra state.

The checkpoints are real (``save_checkpoint`` of a real Megatron ``PolicyTrainer`` in a gloo
process); the damage is what a kill mid-write, a full disk or a crafted file leaves behind.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_darl.loop.config import LoopConfig
from megatron_darl.loop.metrics import MetricsLogger
from megatron_darl.checkpoint.training import load_extra_states

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "procs"))


def _logger(run_dir: Path, start_step: int) -> MetricsLogger:
    cfg = LoopConfig(run_dir=str(run_dir), progress_bar=False, plot=False, tensorboard=False)
    return MetricsLogger(cfg, None, start_step)


@pytest.mark.fault(kind="file", name="metrics.jsonl cut mid-record (kill during a write)")
def test_a_cut_off_last_metrics_line_does_not_block_resume(tmp_path, fault_record):
    """Resume drops the partial last record with a warning and goes on; nothing before it is lost."""
    rows = [{"step": s, "reward_mean": 0.1 * s, "wall_seconds": float(s)} for s in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + json.dumps({"step": 3, "reward_mean": 0.3})[:17])
    logger = _logger(tmp_path, start_step=3)
    logger.log(3, {"reward_mean": 0.4})
    logger.close()
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == [0, 1, 2, 3]
    assert written[3]["reward_mean"] == 0.4 and written[3]["wall_seconds"] >= 2.0
    fault_record["observed"] = "partial record dropped with a warning; steps 0-2 kept, step 3 rewritten"


@pytest.mark.fault(kind="file", name="metrics.jsonl damaged mid-file")
def test_a_damaged_metrics_line_in_the_middle_is_named(tmp_path, fault_record):
    """A bad record that is not the last one stops resume with an error naming the file and line."""
    lines = [json.dumps({"step": 0}), "{garbage", json.dumps({"step": 2})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        _logger(tmp_path, start_step=3)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3  # left as it was
    fault_record["observed"] = "ValueError '<run>/metrics.jsonl:2: not a JSON record ...'; file untouched"


class _Payload:
    """Runs code when unpickled (what a crafted checkpoint would carry)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


@pytest.mark.fault(kind="file", name="crafted pickle in checkpoint extra/*.pt")
def test_a_crafted_extra_state_pickle_is_refused_before_it_runs(tmp_path, fault_record):
    """Loading refuses the file by name and its code never runs; plain extra state still loads."""
    ckpt = tmp_path / "step_000002"
    (ckpt / "extra").mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"planner": _Payload(str(marker))}, ckpt / "extra" / "dp00000.pt")
    with pytest.raises(ValueError, match=r"dp00000.pt: refused: it holds objects other than tensors"):
        load_extra_states(ckpt, 1)
    assert not marker.exists()
    plain = {"planner": {"rows": [torch.ones(3)], "k": 4, "name": "x"}, "step": 2, "worker_groups": [1, 2]}
    torch.save(plain, ckpt / "extra" / "dp00000.pt")
    assert load_extra_states(ckpt, 1)[0]["worker_groups"] == [1, 2]
    fault_record["observed"] = "ValueError naming extra/dp00000.pt (weights_only refused it); no code ran"


def _save_damage_load(rank: int, world: int, root: str, out: str) -> None:
    """Gloo worker: two real checkpoints, a truncated shard in the newer, then load attempts."""
    import trainer_procs

    from megatron_darl.checkpoint.training import load_checkpoint, save_checkpoint
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp=1, pp=1, timeout_s=120))
    trainer = trainer_procs._production_trainer(ps, "")
    for step in (1, 2):
        trainer.train_step(trainer_procs.make_batch(), trainer_procs.toy_loss)
        save_checkpoint(trainer, Path(root) / f"step_{step:06d}", extra_state={"step": step, "rows": [torch.ones(2)]})
    newest = Path(root) / "step_000002"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = {"shard": str(shard)}
    try:
        load_checkpoint(trainer, newest)
        result["error"] = None
    except ValueError as exc:
        result["error"] = str(exc)
    result["previous_step"] = load_checkpoint(trainer, Path(root) / "step_000001").extra_states[0]["step"]
    Path(out).write_text(json.dumps(result))


@pytest.mark.fault(kind="file", name="truncated .distcp shard of the newest checkpoint")
def test_a_truncated_shard_is_named_and_the_previous_checkpoint_offered(tmp_path, fault_record):
    """Resume fails naming the shard file and the checkpoint, and offers the previous checkpoint (which loads)."""
    from megatron_darl.trainer.parallel import run_local_gloo

    root, out = tmp_path / "checkpoints", tmp_path / "result.json"
    run_local_gloo(_save_damage_load, 1, args=(str(root), str(out)), timeout_s=300)
    result = json.loads(out.read_text())
    error = result["error"]
    assert error is not None and "\n" not in error
    assert result["shard"] in error and "truncated" in error
    assert f"checkpoint {root / 'step_000002'} is damaged" in error
    assert f"the previous checkpoint is {root / 'step_000001'}" in error and "mv " in error
    assert result["previous_step"] == 1
    fault_record["observed"] = "one line: 'checkpoint .../step_000002 is damaged: .../__0_0.distcp: checkpoint " \
                               "shard truncated (...); the previous checkpoint is .../step_000001: move the " \
                               "damaged one aside ...'; the previous one loads"
    fault_record["lost"] = "the steps after the previous checkpoint (the damaged one is kept for inspection)"
