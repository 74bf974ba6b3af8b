"""Megatron DDP, the distributed (ZeRO-1) Adam optimizer and the warmup-then-constant LR.

Everything here is Megatron's own machinery (``DistributedDataParallel`` with contiguous grad
buckets, ``get_megatron_optimizer`` -> ``DistributedOptimizer`` with fp32 master weights,
``OptimizerParamScheduler``) configured for RL post-training: no loss scaling (fp32 on CPU, bf16
on GPU), gradients reduced once after the last micro-batch by default (``trainer.overlap_grad_reduce``
reduce-scatters each bucket during the backward instead; the schedule then runs every micro-batch
but the last under ``no_sync``: ``sync_hooks``), and the loss
normalised per token by Megatron itself (``calculate_per_token_loss``: each micro-batch returns
its loss *sum* and token count; ``finalize_model_grads`` divides the gradients by the token count
summed over micro-batches and DP ranks). Keyword arguments that differ between megatron-core
0.16 and 0.19 are filtered against the installed signatures. Without Transformer Engine or apex
(as on our GPU machines), Megatron's Python stand-ins for apex's multi-tensor kernels are swapped
for ``torch._foreach`` ones: theirs sync the host once per gradient tensor (``use_foreach_fallbacks``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from megatron_darl.trainer.config import OptimizerConfig, TrainerConfig


def supported_kwargs(fn, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` accepts (megatron-core APIs move between releases)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def wrap_ddp(chunks: list, parallel_state, cfg: TrainerConfig, bf16: bool) -> list:
    """Wrap model chunks in Megatron DDP and make DP replicas start from identical weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_kwargs = dict(
        grad_reduce_in_fp32=bool(bf16 and cfg.grad_reduce_in_fp32),
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=False,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    ddp_config = DistributedDataParallelConfig(
        **supported_kwargs(DistributedDataParallelConfig, ddp_kwargs)
    )
    wrapped = []
    for chunk in chunks:
        kwargs = dict(
            config=chunk.config, ddp_config=ddp_config, module=chunk,
            pg_collection=parallel_state.pg_collection,
        )
        ddp = DistributedDataParallel(**supported_kwargs(DistributedDataParallel.__init__, kwargs))
        ddp.broadcast_params()
        wrapped.append(ddp)
    return wrapped


def sync_hooks(config, ddp_chunks: list, overlap_grad_reduce: bool) -> None:
    """With ``overlap_grad_reduce``, what Megatron's schedule needs on the model config (as
    Megatron-LM's training loop sets it): ``no_sync_func`` keeps the buckets from reducing before
    the last micro-batch's backward, ``grad_sync_func`` starts a chunk's reduce once its last
    backward is done (pipeline schedules)."""
    if not overlap_grad_reduce:
        return
    no_sync = [chunk.no_sync for chunk in ddp_chunks]
    start = [chunk.start_grad_sync for chunk in ddp_chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.grad_sync_func = start[0] if len(start) == 1 else start


def build_optimizer(ddp_chunks: list, opt: OptimizerConfig, parallel_state, bf16: bool):
    """Megatron optimizer (distributed when configured) over the DDP-wrapped chunks."""
    from megatron.core import optimizer as mopt

    mcfg_kwargs = dict(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad, bf16=bf16, fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        decoupled_weight_decay=True,
    )
    mcfg = mopt.OptimizerConfig(**supported_kwargs(mopt.OptimizerConfig, mcfg_kwargs))
    kwargs: dict[str, Any] = dict(
        config=mcfg, model_chunks=ddp_chunks, pg_collection=parallel_state.pg_collection,
        use_gloo_process_groups=False,  # refused together with pg_collection
    )
    if hasattr(mopt, "get_standard_config_overrides"):
        # No weight decay on norms/biases (Megatron's classic rule; the default in <=0.15).
        kwargs["config_overrides"] = mopt.get_standard_config_overrides(mcfg)
    optimizer = mopt.get_megatron_optimizer(**supported_kwargs(mopt.get_megatron_optimizer, kwargs))
    if parallel_state.device.type == "cuda":
        use_fused_torch_adam(optimizer)
    use_foreach_fallbacks()
    return optimizer


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Megatron's ``local_multi_tensor_l2_norm`` without its host syncs: the same (1,) fp32 norm
    of every tensor of ``tensor_lists``, from one ``torch._foreach_norm``, left on the device."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device="cuda"), None
    norms = torch._foreach_norm(tensors, 2)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Megatron's ``local_multi_tensor_scale`` (``dst = src * scale`` for each pair) in two
    multi-tensor launches instead of two per tensor."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if src:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def fallback_swaps() -> list[tuple]:
    """(module, attribute, megatron-core's stand-in, ours) for each swap ``use_foreach_fallbacks``
    makes (``benchmarks/train_step.py --megatron-fallbacks`` puts theirs back)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as base

    return [(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, foreach_l2_norm),
            (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale),
            (base, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale)]


def use_foreach_fallbacks() -> int:
    """Without Transformer Engine or apex, megatron-core's stand-ins for apex's multi-tensor
    kernels cost one host sync per gradient tensor: the gradient norm (every optimizer step)
    turns each tensor's norm into a Python float, and the host cannot queue work ahead of the
    device meanwhile. Swap them for ``torch._foreach`` versions (same values, kept on the
    device); a no-op where TE or apex supplied the real kernels. At 1.7B on DP2 (2x H200, four
    optimizer steps of 16 x 640 tokens) a step's device syncs go from 628 to 72; its time did not
    move beyond run-to-run noise there (``benchmarks/train_step.py --megatron-fallbacks`` is
    the A/B). Returns how many module attributes were swapped."""
    swapped = 0
    for module, name, local, ours in fallback_swaps():
        if getattr(module, name, None) is local:
            setattr(module, name, ours)
            swapped += 1
    return swapped


def use_fused_torch_adam(optimizer) -> int:
    """Switch Megatron's torch ``Adam``/``AdamW`` fallback (no TE, no apex) to the fused kernel.

    Without Transformer Engine or apex, megatron-core builds ``torch.optim.AdamW`` with torch's
    default multi-tensor (foreach) path; the fused CUDA kernel does the same update in one pass
    over the fp32 master weights. Returns how many inner optimizers were switched.
    """
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    switched = 0
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for g in torch_opt.param_groups for p in g["params"]]
        if not params or not all(p.is_cuda and p.dtype == torch.float32 for p in params):
            continue
        for group in torch_opt.param_groups:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched


def build_lr_scheduler(optimizer, opt: OptimizerConfig):
    """Linear warmup from ``warmup_init_lr`` to ``lr`` over ``warmup_steps``, then constant.

    The trainer advances the scheduler *before* each optimizer step, so step k (0-based) runs at
    ``warmup_init_lr + (lr - warmup_init_lr) * (k + 1) / warmup_steps`` during warmup: the first
    step already moves the weights even when ``warmup_init_lr`` is 0.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    kwargs = dict(
        optimizer=optimizer,
        init_lr=opt.warmup_init_lr if opt.warmup_steps > 0 else opt.lr,
        max_lr=opt.lr,
        min_lr=min(opt.min_lr, opt.lr),
        lr_warmup_steps=opt.warmup_steps,
        lr_decay_steps=opt.warmup_steps + 1,
        lr_decay_style="constant",
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
    return OptimizerParamScheduler(**supported_kwargs(OptimizerParamScheduler.__init__, kwargs))
