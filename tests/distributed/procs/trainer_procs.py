"""Worker bodies of the trainer's distributed tests (run by ``parallel.run_local_gloo``).

One launch per world size runs its layouts one after the other (``destroy_parallel`` keeps the
default group), and each layout computes everything the tests compare:
log-probs at init, loss/grad-norm and the full HF-named parameters after one step, and
optionally a checkpoint (saved after step 1, then step 2 run straight) or a resume from one.
Rank 0 writes the results to ``out_path`` with ``torch.save``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

VOCAB = 256
SEQ_LENS = [37, 12, 25, 40, 9, 30, 18, 33]
PROMPT_LEN = 6


def tiny_hf_config_dict() -> dict:
    """The tiny Qwen3 every trainer test uses (HF ``config.json`` content)."""
    return dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=VOCAB, hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=512,
    )


@dataclass
class ToyInputs:
    """The toy loss's per-token inputs, in the scored layout (the trainer only slices them)."""

    prox: torch.Tensor  # (n,) ratio base
    w: torch.Tensor  # (n,) weights
    adv: torch.Tensor  # (n,) the sequence's advantage, per token


def save_tiny_hf(path, initializer_range: float | None = 0.2):
    """The tiny Qwen3 (``tiny_hf_config_dict``, seed 0) saved as an HF checkpoint at ``path``;
    returns the transformers model. ``initializer_range`` None: transformers' default init."""
    import transformers

    cfg = {k: v for k, v in tiny_hf_config_dict().items() if k != "model_type"}
    if initializer_range is not None:
        cfg["initializer_range"] = initializer_range
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    model.save_pretrained(path)
    return model


def make_batch(indices: list[int] | None = None):
    """The fixed test batch (or the sequences ``indices`` of it), with typed loss inputs."""
    from megatron_darl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, VOCAB, (n,), generator=g) for n in SEQ_LENS]
    masks = [torch.arange(n) >= PROMPT_LEN for n in SEQ_LENS]
    scored = torch.tensor([n - PROMPT_LEN for n in SEQ_LENS])
    prox = -5.5 + 0.1 * torch.randn(int(scored.sum()), generator=g)
    weight = 0.5 + torch.rand(int(scored.sum()), generator=g)
    adv = torch.repeat_interleave(torch.randn(len(SEQ_LENS), generator=g), scored)
    full = TrainBatch.from_sequences(tokens, masks, ToyInputs(prox, weight, adv))
    return full if indices is None else full.select(indices)


def toy_loss(logp: torch.Tensor, batch_slice):
    """A PPO-shaped token-sum loss that uses every input (trainer-agnostic)."""
    x = batch_slice.loss_inputs
    ratio = torch.exp(logp - x.prox)
    per_token = -ratio * x.adv * x.w
    return per_token.sum(), {"ratio_mean": float(ratio.mean())}


def _trainer(tp: int, pp: int, hf_dir: str, token_budget: int):
    from megatron_darl.models.qwen3.weights import load_hf_checkpoint
    from megatron_darl.trainer.config import MicroBatchConfig, OptimizerConfig, TrainerConfig
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    ps = init_parallel(ParallelConfig(tp=tp, pp=pp, timeout_s=300))
    cfg = TrainerConfig(
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0, adam_eps=1e-6),
        micro_batch=MicroBatchConfig(token_budget=token_budget, max_seq_len=64, pad_multiple=8),
        bf16=False,
    )
    from megatron_darl.models.qwen3.model import build_qwen3_model

    chunks = build_qwen3_model(tiny_hf_config_dict(), ps, calculate_per_token_loss=True)
    load_hf_checkpoint(chunks, hf_dir, ps)
    return PolicyTrainer(cfg, ps, tiny_hf_config_dict(), model_chunks=chunks), ps


def gather_hf_params(trainer, ps) -> dict[str, torch.Tensor] | None:
    """All HF-named full tensors on global rank 0 (stages and DP replica 0 only)."""
    mine = {k: v.detach().cpu().clone() for k, v in trainer.export_hf_stage()}
    if ps.dp_rank != 0 or ps.tp_rank != 0:
        mine = {}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return out


def layouts_worker(rank, world_size, hf_dir, layouts):
    """Run ``layout_worker`` for each ``(tp, pp, out_path, save, load, init)`` in turn."""
    from megatron_darl.trainer.parallel import destroy_parallel

    for tp, pp, out_path, save, load, init in layouts:
        layout_worker(rank, world_size, tp, pp, hf_dir, out_path, save, load, init)
        destroy_parallel(keep_default_group=True)


def layout_worker(rank, world_size, tp, pp, hf_dir, out_path, ckpt_save=None, ckpt_load=None,
                  ckpt_init=None):
    """Log-probs, one step, params; optionally checkpoint after step 1 or resume and step.

    ``ckpt_init``: also build a second trainer through the production path (random init, then
    ``TrainerConfig.init_checkpoint``) and record its log-probs.
    """
    from megatron_darl.trainer.batch import broadcast_batch
    from megatron_darl.checkpoint.training import load_checkpoint, save_checkpoint

    trainer, ps = _trainer(tp, pp, hf_dir, token_budget=96)
    shard = list(range(ps.dp_rank, len(SEQ_LENS), ps.dp_size))
    batch = make_batch(shard)
    result: dict = {"logp0": trainer.compute_logprobs(batch), "shard": shard}
    result["num_microbatches"] = len(trainer._microbatches(batch))
    result["fused_layers"] = trainer.fused_layers
    result["export0_vs_hf"] = _export_vs_hf(gather_hf_params(trainer, ps), hf_dir)
    got = broadcast_batch(batch if ps.tp_rank == ps.pp_rank == 0 else None, ps, ToyInputs)
    result["broadcast_ok"] = bool(
        torch.equal(got.input_ids, batch.input_ids) and torch.equal(got.loss_inputs.w, batch.loss_inputs.w)
        and got.loss_inputs.w.device.type == "cpu"
    )
    trainer.snapshot()  # version 0
    step = trainer.train_step(batch, toy_loss)
    result.update(step1=step, params1=gather_hf_params(trainer, ps))
    result["logp1"] = trainer.compute_logprobs(batch)
    result["logp0_snapshot"] = trainer.compute_logprobs(batch, version=0)
    result["logp1_after_swap"] = trainer.compute_logprobs(batch)
    result["errors"] = _bad_input_errors(trainer, batch)
    if ckpt_save:  # both optimizer formats: DP-reshardable and fully reshardable
        save_checkpoint(trainer, ckpt_save, extra_state={"dp_rank": ps.dp_rank})
        save_checkpoint(trainer, ckpt_save + "_full", optim_sharding="fully_reshardable")
        result["step2"] = trainer.train_step(batch, toy_loss)
        result["params2"] = gather_hf_params(trainer, ps)
    if ckpt_load:
        if ckpt_load.endswith("_full"):  # refused in the DP-only format, loads in the full one
            try:
                load_checkpoint(trainer, ckpt_load[: -len("_full")])
            except ValueError as exc:
                result["errors"].append(str(exc))
        resumed = load_checkpoint(trainer, ckpt_load)
        result["resumed"] = resumed
        result["step2"] = trainer.train_step(batch, toy_loss)
        result["params2"] = gather_hf_params(trainer, ps)
    if ckpt_init:
        result["logp_init_ckpt"] = _production_trainer(ps, ckpt_init).compute_logprobs(batch)
    all_logp = [None] * world_size
    dist.all_gather_object(all_logp, (ps.dp_rank, shard, result["logp0"], result["logp1"]))
    flags = [None] * world_size
    dist.all_gather_object(flags, result["broadcast_ok"])
    result["broadcast_ok"] = all(flags)
    if rank == 0:
        result["all_logp"] = all_logp
        torch.save(result, out_path)


def _export_vs_hf(exported: dict, hf_dir: str) -> float:
    """Max abs difference between the trainer's HF export and the HF checkpoint it loaded."""
    from safetensors.torch import load_file

    ref = load_file(f"{hf_dir}/model.safetensors")
    ref.pop("lm_head.weight", None)  # tied: not exported, as in HF checkpoints
    assert exported.keys() == ref.keys(), sorted(set(exported) ^ set(ref))
    return max(float((exported[k] - ref[k]).abs().max()) for k in ref)


def _production_trainer(ps, init_checkpoint: str):
    from megatron_darl.trainer.config import MicroBatchConfig, TrainerConfig
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    cfg = TrainerConfig(
        micro_batch=MicroBatchConfig(token_budget=128, max_seq_len=64, pad_multiple=8),
        bf16=False, init_checkpoint=init_checkpoint,
    )
    return PolicyTrainer(cfg, ps, tiny_hf_config_dict())


def _bad_input_errors(trainer, batch) -> list[str]:
    """Messages of the errors that over-long and out-of-vocab sequences raise."""
    from megatron_darl.trainer.batch import TrainBatch

    messages = []
    too_long = TrainBatch.from_sequences(
        [torch.zeros(10, dtype=torch.long), torch.zeros(65, dtype=torch.long)],
        [torch.arange(10) > 0, torch.arange(65) > 0],
    )
    bad_ids = TrainBatch.from_sequences([torch.full((4,), VOCAB)], [torch.arange(4) > 0])
    for bad in (too_long, bad_ids):
        try:
            trainer.compute_logprobs(bad)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def overlap_worker(rank, world_size, hf_dir, out_path):
    """DP2: two steps of the same two mini-batches (several micro-batches each) trained by a
    trainer that reduces gradients after the backward and by one that overlaps the reduce with it
    (``trainer.overlap_grad_reduce``); the parameters after, and for each mini-batch whether its
    reduce was in flight when ``finalize_model_grads`` was reached (issued during the backward)."""
    from megatron_darl.models.qwen3.model import build_qwen3_model
    from megatron_darl.models.qwen3.weights import load_hf_checkpoint
    from megatron_darl.trainer.config import MicroBatchConfig, OptimizerConfig, TrainerConfig
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel
    from megatron_darl.trainer.policy_trainer import PolicyTrainer

    ps = init_parallel(ParallelConfig(timeout_s=300))
    shard = list(range(ps.dp_rank, len(SEQ_LENS), ps.dp_size))
    half = len(shard) // 2
    minibatches = [make_batch(shard[:half]), make_batch(shard[half:])]
    result: dict = {}
    for overlap in (False, True):
        cfg = TrainerConfig(optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0, adam_eps=1e-6),
                            micro_batch=MicroBatchConfig(token_budget=40, max_seq_len=40, pad_multiple=8),
                            bf16=False, overlap_grad_reduce=overlap)
        chunks = build_qwen3_model(tiny_hf_config_dict(), ps, calculate_per_token_loss=True)
        load_hf_checkpoint(chunks, hf_dir, ps)
        trainer = PolicyTrainer(cfg, ps, tiny_hf_config_dict(), model_chunks=chunks)
        config, finalize, in_flight = chunks[0].config, chunks[0].config.finalize_model_grads_func, []

        def seen(*args, _finalize=finalize, **kwargs):  # the reduce issued before finalize?
            in_flight.append(all(g.grad_reduce_handle is not None for c in trainer.model for g in c.bucket_groups))
            return _finalize(*args, **kwargs)

        config.finalize_model_grads_func = seen
        trainer.train_steps(minibatches, toy_loss)  # the first learns which params get gradients
        step = trainer.train_steps(minibatches, toy_loss)
        result[overlap] = {"params": gather_hf_params(trainer, ps), "loss": step.loss, "in_flight": in_flight,
                           "microbatches": [len(trainer._microbatches(b)) for b in minibatches]}
        config.no_sync_func = config.grad_sync_func = None  # the next trainer's chunks share no config
    if rank == 0:
        torch.save(result, out_path)
