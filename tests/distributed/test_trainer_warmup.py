"""``PolicyTrainer.warm_up`` changes nothing a step sees (DP2 on gloo, two processes).

On GPU the warm-up compiles the trainer's kernels before the first wait (``trainer.compile_warmup``);
its passes are collectives and leave the gradients in the buffers, so it must leave the weights,
the optimizer and the next step exactly as they were. Here it is forced on CPU (nothing compiles,
the same calls run): the weights after it are bitwise the same, and a train step after it gives
the same loss and weights as one without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "procs"))
import trainer_procs  # noqa: E402


def warm_worker(rank: int, world_size: int, hf_dir: str, out_path: str, warm: bool) -> None:
    from resume_procs import tiny_trainer
    from trainer_procs import gather_hf_params

    from megatron_darl.trainer.batch import TrainBatch

    trainer, ps = tiny_trainer(hf_dir)
    before = gather_hf_params(trainer, ps)
    seconds = trainer.warm_up([40, 17], force=True) if warm else 0.0
    after = gather_hf_params(trainer, ps)
    g = torch.Generator().manual_seed(7 + ps.dp_rank)  # each DP replica its own batch
    lens = torch.tensor([30, 22, 11])
    ids = torch.randint(0, trainer.spec.vocab_size, (int(lens.sum()),), generator=g)
    pos = torch.cat([torch.arange(int(n)) for n in lens])
    batch = TrainBatch(ids, lens, pos >= 5, None)
    result = trainer.train_step(batch, lambda logp, b: (-(logp * torch.linspace(0.5, 1.5, logp.numel())).sum(), {}))
    if rank == 0:
        torch.save({"before": before, "after": after, "seconds": seconds, "loss": result.loss,
                    "version": trainer.version, "step": trainer.optimizer_steps,
                    "params": gather_hf_params(trainer, ps)}, out_path)
    else:
        gather_hf_params(trainer, ps)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_darl.trainer.parallel import run_local_gloo

    work = tmp_path_factory.mktemp("warmup")
    trainer_procs.save_tiny_hf(work / "hf")
    out = {}
    for warm in (False, True):
        path = work / f"warm{int(warm)}.pt"
        run_local_gloo(warm_worker, 2, args=(str(work / "hf"), str(path), warm), timeout_s=600)
        out[warm] = torch.load(path, weights_only=False)
    return out


def test_the_warm_up_leaves_weights_optimizer_and_the_next_step_as_they_were(runs):
    warm, cold = runs[True], runs[False]
    assert warm["seconds"] > 0  # it ran (forced on CPU)
    for name, value in warm["before"].items():
        assert torch.equal(value, warm["after"][name]), name
    assert warm["version"] == cold["version"] == 1 and warm["step"] == cold["step"] == 1
    assert warm["loss"] == cold["loss"]
    for name, value in cold["params"].items():
        assert torch.equal(value, warm["params"][name]), name
    assert any(not torch.equal(v, cold["before"][k]) for k, v in cold["params"].items())  # the step moved them
