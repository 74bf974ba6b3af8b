"""Unit tests of the trainer's batch contract, micro-batch planning and chunked log-probs."""

from dataclasses import dataclass

import pytest
import torch

from megatron_darl.trainer.batch import TrainBatch, make_microbatch, plan_microbatches, split_microbatches
from megatron_darl.trainer.logprobs import vocab_parallel_logprobs


@dataclass
class Inputs:
    """A loss's typed per-token inputs (the trainer only slices them)."""

    w: torch.Tensor  # (n,)
    adv: torch.Tensor  # (n,)


def _batch(lens=(5, 3, 7), prompt=2):
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 50, (n,), generator=g) for n in lens]
    masks = [torch.arange(n) >= prompt for n in lens]
    scored = [n - prompt for n in lens]  # 3, 1, 5
    adv = torch.repeat_interleave(torch.tensor([1.0, -2.0, 3.0]), torch.tensor(scored))
    return TrainBatch.from_sequences(tokens, masks, Inputs(torch.rand(sum(scored), generator=g), adv))


def test_logprobs_match_log_softmax_and_grad():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(11, 7, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 7, (11,), generator=g)
    out = vocab_parallel_logprobs(logits, targets, chunk_tokens=4)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(out.float(), ref.float(), atol=1e-6)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs(x, targets, chunk_tokens=5), (logits,),
        atol=1e-4,
    )


def test_logprobs_at_a_temperature_match_scaled_log_softmax_and_grad():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 7, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 7, (9,), generator=g)
    out = vocab_parallel_logprobs(logits, targets, chunk_tokens=4, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs(x, targets, chunk_tokens=5, temperature=0.7), (logits,))
    one = vocab_parallel_logprobs(logits.float(), targets, temperature=1.0)  # scale 1 is exact
    assert torch.equal(one, vocab_parallel_logprobs(logits.float(), targets))
    padded = logits.detach().float().clone()
    padded[:, -2:] = torch.finfo(torch.float32).min  # padded vocab columns: no NaN once scaled
    assert torch.isfinite(vocab_parallel_logprobs(padded, targets.clamp(max=4), temperature=0.5)).all()
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, targets, temperature=0.0)


def test_plan_respects_budget_and_sorts():
    lens = [10, 100, 33, 64, 65, 7]
    plan = plan_microbatches(lens, token_budget=192, pad_multiple=32)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lens)))
    for mb in plan:
        padded = -(-max(lens[i] for i in mb) // 32) * 32
        assert len(mb) * padded <= 192 or len(mb) == 1
        assert [lens[i] for i in mb] == sorted((lens[i] for i in mb), reverse=True)
    assert plan[0] == [1]  # 100 -> 128 padded: a second row would exceed 192


def test_microbatch_alignment_and_fields():
    batch = _batch()
    mb = make_microbatch(batch, [2, 0], pad_multiple=4, device=torch.device("cpu"))
    sub = mb.batch
    assert mb.shape == (2, 8)
    # every scored token's logits row points at the previous position of the same row
    flat = mb.input_ids.flatten()
    assert torch.equal(flat[mb.pred_rows + 1], mb.targets)
    assert torch.equal(batch.input_ids[batch.loss_mask][mb.scored_index], mb.targets)
    assert torch.equal(sub.input_ids[sub.loss_mask], mb.targets)
    # the loss inputs follow their tokens: sequence 2's five, then sequence 0's three
    assert torch.equal(sub.loss_inputs.w, batch.loss_inputs.w[mb.scored_index])
    assert sub.loss_inputs.adv.tolist() == [3.0] * 5 + [1.0] * 3
    assert mb.scored_index.tolist() == [4, 5, 6, 7, 8, 0, 1, 2]


def test_split_microbatches_builds_what_each_micro_batch_alone_builds():
    """``split_microbatches`` takes the batch's scored index once for all its micro-batches; each
    must equal ``make_microbatch`` computing its own, field by field."""
    batch, cpu = _batch(), torch.device("cpu")
    plan = plan_microbatches(batch.seq_lens.tolist(), token_budget=8, pad_multiple=4)
    split = split_microbatches(batch, token_budget=8, pad_multiple=4, device=cpu)
    assert len(split) == len(plan) == 3
    for mb, idx in zip(split, plan):
        alone = make_microbatch(batch, idx, pad_multiple=4, device=cpu)
        for name in ("input_ids", "position_ids", "pred_rows", "targets", "scored_index"):
            assert torch.equal(getattr(mb, name), getattr(alone, name)), name
        for name in ("input_ids", "seq_lens", "loss_mask"):
            assert torch.equal(getattr(mb.batch, name), getattr(alone.batch, name)), name
        assert torch.equal(mb.batch.loss_inputs.w, alone.batch.loss_inputs.w)
        assert torch.equal(mb.batch.loss_inputs.w, batch.loss_inputs.w[mb.scored_index])


def test_bad_batches_raise():
    with pytest.raises(ValueError, match="first token"):
        TrainBatch.from_sequences([torch.arange(3)], [torch.tensor([True, True, False])])
    with pytest.raises(ValueError, match=r"loss_inputs.w must be \(3,\)"):
        TrainBatch(torch.arange(4), torch.tensor([4]), torch.arange(4) > 0,
                   loss_inputs=Inputs(torch.zeros(2), torch.zeros(3)))
    with pytest.raises(TypeError, match="dataclass"):
        TrainBatch(torch.arange(4), torch.tensor([4]), torch.arange(4) > 0, loss_inputs={"w": torch.zeros(3)})
