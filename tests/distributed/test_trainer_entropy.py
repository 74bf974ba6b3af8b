"""The entropy the train step hands its loss (``train_steps(..., entropy=True)``) at TP = 2 is the
entropy of the HF model's sampled distribution, token by token (gloo, two processes).

The tiny Qwen3 is split over two TP ranks (vocab-parallel logits, micro-batches by a token budget,
temperature 0.8); each scored token's entropy and log-prob, as the loss function receives them, is
compared with ``softmax(logits / T)`` of the same weights in transformers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "procs"))
import trainer_procs  # noqa: E402

T = 0.8


@dataclass
class Index:
    """Each scored token's position in the batch's scored layout (sliced with the tokens)."""

    idx: torch.Tensor  # (n,) float32


def entropy_worker(rank: int, world_size: int, hf_dir: str, out_path: str) -> None:
    from trainer_procs import _trainer

    from megatron_darl.trainer.batch import TrainBatch

    trainer, ps = _trainer(2, 1, hf_dir, token_budget=96)
    trainer.temperature = T
    full = trainer_procs.make_batch()
    batch = TrainBatch(full.input_ids, full.seq_lens, full.loss_mask,
                       Index(torch.arange(full.num_loss_tokens, dtype=torch.float32)))
    ent_out = torch.full((full.num_loss_tokens,), float("nan"))
    logp_out = ent_out.clone()

    def loss_fn(logp, b, entropy):
        at = b.loss_inputs.idx.long().cpu()
        ent_out[at], logp_out[at] = entropy.detach().float().cpu(), logp.detach().float().cpu()
        return -(0.01 * entropy.sum() + logp.sum()), {}

    result = trainer.train_steps([batch], loss_fn, entropy=True)
    if rank == 0:
        torch.save({"entropy": ent_out, "logp": logp_out, "loss": result.loss}, out_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_darl.trainer.parallel import run_local_gloo

    work = tmp_path_factory.mktemp("entropy")
    hf_model = trainer_procs.save_tiny_hf(work / "hf")
    run_local_gloo(entropy_worker, 2, args=(str(work / "hf"), str(work / "out.pt")), timeout_s=400)
    return torch.load(work / "out.pt", weights_only=False), hf_model


def test_train_step_entropy_and_logprobs_at_tp2_match_hf(run):
    out, model = run
    batch = trainer_procs.make_batch()
    offs = batch.offsets.tolist()
    ent, logp = torch.zeros(batch.num_tokens), torch.zeros(batch.num_tokens)
    with torch.no_grad():
        for i in range(batch.num_sequences):
            ids = batch.input_ids[offs[i]:offs[i + 1]]
            lp = torch.log_softmax(model(ids[None]).logits[0].double() / T, -1)[:-1]  # position p from p - 1
            ent[offs[i] + 1:offs[i + 1]] = (-(lp.exp() * lp).sum(-1)).float()
            logp[offs[i] + 1:offs[i + 1]] = lp.gather(-1, ids[1:, None]).squeeze(-1).float()
    torch.testing.assert_close(out["entropy"], ent[batch.loss_mask], atol=2e-4, rtol=0)
    torch.testing.assert_close(out["logp"], logp[batch.loss_mask], atol=2e-4, rtol=0)
    assert out["entropy"].std() > 0.01  # not a constant (e.g. the uniform distribution's)
