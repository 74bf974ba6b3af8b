"""Typed configuration of the policy trainer: optimisation, micro-batching, checkpoints.

Hydra composes these from ``configs/trainer/*.yaml``; library code only ever sees the
dataclasses. Parallel layout (TP/PP/DP) lives in ``parallel.ParallelConfig`` and the model in the
HF ``config.json``, so neither is repeated here. Every check that a user can trip raises a
``ValueError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimizerConfig:
    """Adam with decoupled weight decay, global-norm clipping and constant LR after a warmup."""

    lr: float = 1e-6  # peak (and constant) learning rate after warmup
    min_lr: float = 0.0  # unused by the constant schedule; kept for Megatron's scheduler
    warmup_steps: int = 0  # linear warmup from ``warmup_init_lr`` to ``lr`` over this many steps
    warmup_init_lr: float = 0.0  # learning rate at step 0 when warmup_steps > 0
    weight_decay: float = 0.01  # decoupled (AdamW) weight decay; norms and biases get none
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.999  # Adam second-moment decay
    adam_eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # global gradient-norm clip (0 disables)
    use_distributed_optimizer: bool = True  # shard optimizer state over DP (ZeRO-1)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"trainer.optimizer.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"trainer.optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.clip_grad < 0:
            raise ValueError(f"trainer.optimizer.clip_grad must be >= 0, got {self.clip_grad}")
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0):
            raise ValueError(
                f"trainer.optimizer.adam_beta1/adam_beta2 must be in [0, 1), got "
                f"{self.adam_beta1}/{self.adam_beta2}"
            )


@dataclass
class MicroBatchConfig:
    """How a step's sequences are cut into micro-batches for the pipeline schedule."""

    token_budget: int = 16384  # max padded tokens (rows x padded length) per micro-batch
    logprob_token_budget: int | None = None  # same for the forward-only pass; None = 2x token_budget
    max_seq_len: int = 8192  # longest accepted sequence (prompt + response); longer raises
    pad_multiple: int = 64  # padded lengths are rounded up to this (multiple of TP with SP)
    logprob_chunk_tokens: int = 4096  # tokens per fp32 log-softmax chunk on the last stage

    def __post_init__(self) -> None:
        if self.logprob_token_budget is None:
            # no activations are kept for backward: twice the rows fit in the same memory
            self.logprob_token_budget = 2 * self.token_budget
        for name in ("token_budget", "logprob_token_budget", "max_seq_len", "pad_multiple",
                     "logprob_chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.micro_batch.{name} must be > 0, got {getattr(self, name)}")
        padded_max = -(-self.max_seq_len // self.pad_multiple) * self.pad_multiple
        for name in ("token_budget", "logprob_token_budget"):
            if getattr(self, name) < padded_max:
                raise ValueError(
                    f"trainer.micro_batch.{name}={getattr(self, name)} cannot hold one sequence of "
                    f"trainer.micro_batch.max_seq_len={self.max_seq_len} (padded to {padded_max})"
                )


@dataclass
class TrainerConfig:
    """Everything the policy trainer needs besides the parallel layout and the HF model config."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # Adam + schedule
    micro_batch: MicroBatchConfig = field(default_factory=MicroBatchConfig)  # batching
    bf16: bool = True  # bf16 params/activations on GPU (fp32 master weights); CPU is always fp32
    seed: int = 1234  # seed for init and Megatron's model-parallel RNG tracker
    init_checkpoint: str | None = None  # converted dist_checkpointing dir; None = random init
    sequence_parallel: bool = True  # Megatron sequence parallelism when TP > 1 (GPU with Transformer Engine only)
    activation_recompute: bool = False  # recompute every layer in backward (memory for ~1/3 more compute)
    grad_reduce_in_fp32: bool = True  # reduce gradients in fp32 (bf16 runs)
    # DP > 1: reduce-scatter each gradient bucket while the backward still runs (Megatron's DDP
    # buckets) instead of all at once after it; off: the collective sits after every mini-batch
    overlap_grad_reduce: bool = False
    peak_tflops: float = 989.0  # per-device dense bf16 peak for MFU (H100/H200 SXM)
    snapshots: str = "auto"  # where backfill's parameter snapshots live: auto|device|host (snapshots.py)
    compile_warmup: bool = True  # GPU: compile the fused kernels before the first step (while engines start)
    # GPU: RMSNorm, SwiGLU and bias-dropout-add as torch.compile kernels; off: eager, as on CPU
    # (fewer host calls a layer, more device kernels: an A/B for host-bound small micro-batches)
    compiled_kernels: bool = True
    # TP1 with SDPA and compiled_kernels: each decoder layer as one compiled function of its own
    # parameters (one host call a layer; models/qwen3/fused_layer.py); off, or any other layout:
    # Megatron's layer forward
    fused_layers: bool = True

    def __post_init__(self) -> None:
        if self.snapshots not in ("auto", "device", "host"):
            raise ValueError(f"trainer.snapshots={self.snapshots!r}: use auto, device or host")
        if self.peak_tflops <= 0:
            raise ValueError(f"trainer.peak_tflops must be > 0, got {self.peak_tflops}")


@dataclass
class ParallelConfig:
    """Model-parallel layout; the data-parallel size is derived from the world size."""

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    seed: int = 1234  # Megatron RNG seed (TP ranks get seed + 2718 + tp_rank)
    backend: str = "auto"  # "nccl", "gloo" or "auto" (nccl when CUDA is available)
    timeout_s: float = 600.0  # timeout of every collective on the created groups

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"ParallelConfig.backend must be auto|nccl|gloo, got {self.backend!r}")
