"""Model FLOPs of a Qwen3 step, for MFU: what the model must compute, not what we padded.

Forward FLOPs of a sequence of length s (matmuls only, 2 FLOPs per multiply-add):

    2 * N_matmul * s                 weights: q, k, v, o, gate, up, down of every layer
                                     AND the LM head (h x V, also when tied); the embedding
                                     lookup is free
  + 4 * L * (heads * head_dim) * s^2 attention scores and weighted sum over the full s x s
                                     matrix (2 matmuls x 2 FLOPs), the PaLM / Megatron-LM
                                     convention, also used by benchmarks/model_step.py;
                                     ``causal=True`` halves it (the work a causal kernel does)

Per token of a train step that is the familiar ``6 * N + 12 * L * H * Q * s``. A training step
(forward + backward) is 3x the forward; the log-prob pass is 1x. Padding, recomputation and the
optimizer are not counted, so MFU is the useful-work utilisation.
MFU = FLOPs / (seconds * devices * peak), with the dense bf16 peak from ``TrainerConfig``
(989 TFLOP/s for H100/H200 SXM).
"""

from __future__ import annotations

from megatron_darl.models.qwen3.config import Qwen3Spec


def matmul_params(spec: Qwen3Spec) -> int:
    """Weights that take part in a matmul per token: all layers plus the LM head."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * spec.num_heads * d * 2 + h * spec.num_kv_heads * d * 2  # q, o, k, v
    mlp = 3 * h * spec.intermediate_size  # gate, up, down
    return spec.num_layers * (attn + mlp) + h * spec.vocab_size


def forward_flops(spec: Qwen3Spec, seq_lens: list[int], causal: bool = False) -> float:
    """Forward FLOPs of the given sequences (see the module docstring)."""
    n = matmul_params(spec)
    attn = (2 if causal else 4) * spec.num_layers * spec.num_heads * spec.head_dim
    return float(sum(2 * n * s + attn * s * s for s in seq_lens))


def train_flops(spec: Qwen3Spec, seq_lens: list[int], causal: bool = False) -> float:
    """Forward + backward FLOPs (3x forward)."""
    return 3.0 * forward_flops(spec, seq_lens, causal)


def mfu(flops: float, seconds: float, devices: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation of ``devices`` devices over ``seconds``."""
    if seconds <= 0:
        return 0.0
    return flops / (seconds * devices * peak_tflops * 1e12)
