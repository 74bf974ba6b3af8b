"""Qwen3 architecture read from a Hugging Face config, and the Megatron config built from it.

``Qwen3Spec`` is the one typed view of a Qwen3 ``config.json`` that the rest of the code uses:
it validates the architecture once (dense Qwen3 only, named in the error), accepts both the
transformers 5.x ``rope_parameters`` and the older ``rope_theta`` field, and makes the vocab
padding explicit (Megatron needs the vocab divisible by TP; we pad to a TP-independent multiple so
a checkpoint reloads at any TP and strip the padding in the mapping and the logits).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("qwen3",)
VOCAB_MULTIPLE = 128  # Megatron's make_vocab_size_divisible_by default
PRESETS_DIR = Path(__file__).resolve().parents[3] / "configs" / "model"


@dataclass(frozen=True)
class Qwen3Spec:
    """Architecture of one dense Qwen3 model (the fields of its HF ``config.json`` we use)."""

    vocab_size: int  # HF vocab rows (embedding and LM head)
    hidden_size: int
    intermediate_size: int  # SwiGLU inner size (gate and up each)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads = query groups
    head_dim: int  # may differ from hidden_size // num_heads (Megatron kv_channels)
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    initializer_range: float = 0.02

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope_theta(cfg: Any, source: str) -> float:
    params = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    theta = theta if theta is not None else _get(cfg, "rope_theta")
    if theta is None:
        raise ValueError(f"{source}: no rope_theta (rope_parameters.rope_theta or rope_theta)")
    rope_type = params.get("rope_type", params.get("type", "default")) if params else "default"
    if rope_type not in (None, "default"):
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported (only default RoPE)")
    return float(theta)


def spec_from_hf(cfg: Any, source: str = "config.json") -> Qwen3Spec:
    """Validate a HF config (``PretrainedConfig`` or dict) as dense Qwen3 and return its spec.

    Raises:
        ValueError: naming ``source`` and the offending field, e.g. another architecture.
    """
    archs = _get(cfg, "architectures") or []
    model_type = _get(cfg, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES or any(
        a not in SUPPORTED_ARCHITECTURES for a in archs
    ):
        found = ",".join(archs) or str(model_type)
        raise ValueError(
            f"{source}: architecture {found} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        hidden, heads = int(_get(cfg, "hidden_size")), int(_get(cfg, "num_attention_heads"))
        spec = Qwen3Spec(
            vocab_size=int(_get(cfg, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_get(cfg, "intermediate_size")),
            num_layers=int(_get(cfg, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(_get(cfg, "num_key_value_heads") or heads),
            head_dim=int(_get(cfg, "head_dim") or hidden // heads),
            rope_theta=_rope_theta(cfg, source),
            rms_norm_eps=float(_get(cfg, "rms_norm_eps")),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=int(_get(cfg, "max_position_embeddings", 40960)),
            initializer_range=float(_get(cfg, "initializer_range", 0.02)),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith(source):
            raise
        raise ValueError(f"{source}: missing or invalid Qwen3 field ({exc})") from None
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"{source}: num_attention_heads {spec.num_heads} is not a multiple of "
            f"num_key_value_heads {spec.num_kv_heads}"
        )
    if _get(cfg, "attention_bias", False):
        raise ValueError(f"{source}: attention_bias=true is not Qwen3 dense (no biases)")
    return spec


def load_hf_config_dict(hf_dir: str | Path) -> dict[str, Any]:
    """Read ``config.json`` of a HF model dir; errors name the file."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (not a Hugging Face model directory)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: corrupt JSON ({exc})") from None


def check_layout(spec: Qwen3Spec, tp: int, pp: int, source: str = "config.json") -> None:
    """Raise ``ValueError`` if TP does not divide heads/query groups or PP the layer count."""
    if spec.num_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={spec.num_heads} ({source})")
    if spec.num_kv_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide num_key_value_heads (query groups)={spec.num_kv_heads} "
            f"({source})"
        )
    if pp > spec.num_layers:
        raise ValueError(f"pp={pp} is larger than num_hidden_layers={spec.num_layers} ({source})")
    if spec.num_layers % pp:
        raise ValueError(
            f"pp={pp} does not divide num_hidden_layers={spec.num_layers} ({source})"
        )


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Vocab rows Megatron allocates: a multiple of ``multiple`` (and of ``tp``).

    Independent of TP whenever ``tp`` divides the ``multiple``-rounded size (always for TP a
    power of two up to 128), so checkpoints reload at any TP. Padded rows are zero in the
    embedding and must be masked in logits (``mask_padded_vocab_``).
    """
    padded = math.ceil(vocab_size / multiple) * multiple
    if padded % tp:
        step = multiple * tp // math.gcd(multiple, tp)
        padded = math.ceil(vocab_size / step) * step
    return padded


def transformer_config_from_hf(
    hf_config: Any,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype | None = None,
    on_cpu: bool = False,
    **overrides: Any,
):
    """Megatron ``TransformerConfig`` for a Qwen3 HF config at this layout and dtype.

    ``overrides`` are passed to ``TransformerConfig`` last (recompute, init options...), and are
    dropped with a ``ValueError`` if this megatron-core version does not know them. ``dtype``
    defaults to float32. torch is imported here, not with the module: the launcher reads model
    shapes (``spec_from_hf``) before it needs torch.
    """
    import dataclasses

    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.float32 if dtype is None else dtype
    spec = hf_config if isinstance(hf_config, Qwen3Spec) else spec_from_hf(hf_config)
    check_layout(spec, tp, pp)
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=spec.initializer_range,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True, use_cpu_initialization=on_cpu,
        # SwiGLU and bias-dropout-add fusions are Megatron's own torch.compile/jit kernels: on
        # for GPU. The rest need apex/TE (rope, grad-accum, softmax) and stay off without them.
        bias_activation_fusion=not on_cpu, bias_dropout_fusion=not on_cpu,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, cross_entropy_loss_fusion=False,
    )
    if on_cpu:
        kwargs["batch_p2p_sync"] = False  # gloo batch_isend_irecv + sync hangs/raises on CPU
    kwargs.update(overrides)
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(kwargs) - known)
    for name in unknown:
        if name in overrides:
            raise ValueError(f"TransformerConfig of this megatron-core has no field {name!r}")
        kwargs.pop(name)
    return TransformerConfig(**kwargs)


def load_preset(name: str) -> dict[str, Any]:
    """HF config dict of a size preset in ``configs/model/<name>.yaml`` (random-init benchmarks)."""
    import yaml

    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESETS_DIR.glob("qwen3*.yaml"))
        raise ValueError(f"{path}: no model preset {name!r}; known: {', '.join(known)}")
    data = yaml.safe_load(path.read_text())
    return dict(data["hf_config"])
