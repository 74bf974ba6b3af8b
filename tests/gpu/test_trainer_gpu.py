"""The policy trainer on one GPU in bf16: log-probs against HF, a train step, pinned snapshots.

Random-init tiny Qwen3 (bf16 parameters, fp32 master weights). The HF reference gets the
trainer's exported bf16 weights (``export_hf_stage``) in fp32, so the only difference is bf16
arithmetic; the tolerance (0.05 nats) is a bf16 bound, the measured value is printed.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "procs"))
import trainer_procs  # noqa: E402


@pytest.fixture(scope="module")
def trainer():
    from megatron_darl.trainer.config import MicroBatchConfig, OptimizerConfig, TrainerConfig
    from megatron_darl.trainer.parallel import destroy_parallel, init_single_process
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    ps = init_single_process()
    cfg = TrainerConfig(
        optimizer=OptimizerConfig(lr=1e-3),
        micro_batch=MicroBatchConfig(token_budget=96, max_seq_len=64, pad_multiple=8),
        bf16=True,
    )
    yield PolicyTrainer(cfg, ps, trainer_procs.tiny_hf_config_dict())
    destroy_parallel()


def _hf_logprobs(trainer, batch) -> torch.Tensor:
    import transformers

    cfg = {k: v for k, v in trainer_procs.tiny_hf_config_dict().items()
           if k not in ("architectures", "model_type")}
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).float().eval()
    state = {k: v.float().cpu() for k, v in trainer.export_hf_stage()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state)
    ref = torch.zeros(batch.num_tokens)
    offs = batch.offsets.tolist()
    with torch.no_grad():
        for i in range(batch.num_sequences):
            ids = batch.input_ids[offs[i] : offs[i + 1]]
            logp = torch.log_softmax(model(ids[None]).logits[0], -1)
            ref[offs[i] + 1 : offs[i + 1]] = logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    return ref[batch.loss_mask]  # the trainer's scored layout: the loss tokens of each sequence in turn


def test_bf16_logprobs_close_to_hf(trainer):
    batch = trainer_procs.make_batch()
    ours = trainer.compute_logprobs(batch)
    diff = (ours - _hf_logprobs(trainer, batch)).abs()
    print(f"bf16 log-prob vs HF fp32: max {diff.max():.4g} mean {diff.mean():.4g}")
    assert float(diff.max()) < 0.05


def test_train_step_and_pinned_snapshot(trainer):
    batch = trainer_procs.make_batch()
    trainer.snapshot()
    before = trainer.compute_logprobs(batch)
    result = trainer.train_step(batch, trainer_procs.toy_loss)
    assert torch.isfinite(torch.tensor([result.loss, result.grad_norm])).all()
    assert result.tokens_per_s > 0 and 0 < result.mfu < 1
    after = trainer.compute_logprobs(batch)
    assert float((after - before).abs().max()) > 1e-3
    assert torch.equal(trainer.compute_logprobs(batch, version=trainer.version - 1), before)
    assert torch.equal(trainer.compute_logprobs(batch), after)
    assert trainer.snapshots.bytes() > 0
    # a tiny model leaves the device room: auto keeps the snapshot there (backfill copies nothing)
    assert trainer.snapshots.resident_versions() == trainer.snapshots.versions
