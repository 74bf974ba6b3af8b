"""Resume into a freshly started trainer, as a relaunched job does (distributed optimizer, DP2).

The layout tests resume into a trainer that has already stepped; a relaunch has not. Here the
run "one step, save, one step" and the run "new processes, load, one step" must give bitwise
the same weights: Adam moments, the Adam step (bias correction), LR schedule and weights all
come back from the checkpoint alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "procs"))
import trainer_procs  # noqa: E402


def _run(rank: int, world: int, mode: str, hf_dir: str, ckpt: str, out: str) -> None:
    from megatron_darl.checkpoint.training import load_checkpoint, save_checkpoint

    trainer, ps = trainer_procs._trainer(1, 1, hf_dir, token_budget=96)
    shard = list(range(ps.dp_rank, len(trainer_procs.SEQ_LENS), ps.dp_size))
    batch = trainer_procs.make_batch(shard)
    if mode == "straight":
        trainer.train_step(batch, trainer_procs.toy_loss)
        save_checkpoint(trainer, ckpt)
    else:
        load_checkpoint(trainer, ckpt)
    trainer.train_step(batch, trainer_procs.toy_loss)
    params = trainer_procs.gather_hf_params(trainer, ps)
    if rank == 0:
        torch.save({"params": params, "step": trainer.optimizer_steps, "version": trainer.version}, out)


def test_resume_into_fresh_processes_is_bitwise(tmp_path):
    from megatron_darl.trainer.parallel import run_local_gloo

    trainer_procs.save_tiny_hf(tmp_path / "hf", initializer_range=None)
    args = (str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    run_local_gloo(_run, 2, args=("straight", *args, str(tmp_path / "a.pt")), timeout_s=400)
    run_local_gloo(_run, 2, args=("resume", *args, str(tmp_path / "b.pt")), timeout_s=400)
    straight, resumed = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert (resumed["step"], resumed["version"]) == (straight["step"], straight["version"]) == (2, 2)
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name
