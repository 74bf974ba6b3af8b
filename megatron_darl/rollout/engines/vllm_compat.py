"""What differs between the vLLM releases we support (``vllm>=0.20,<0.27``), detected, not pinned.

Every vLLM call of the ``vllm`` backend that is not the same in all these releases goes through
here, each one feature-detected on the installed release (a field of ``AsyncEngineArgs`` or
``SamplingParams``, a keyword of a method, a module), so the adapter never depends on one
release's internals:

- engine arguments: only fields the installed ``AsyncEngineArgs`` has are passed; the ones we
  cannot do without (``logprobs_mode`` for processed log-probs, ``worker_extension_cls`` for the
  weight hand-over) raise a clear error when missing;
- token prompts: ``vllm.inputs.engine.tokens_input`` (typed engine input, 0.22+) or the plain
  ``{"prompt_token_ids": ...}`` dict older releases take;
- sampling: ``flat_logprobs`` and ``output_kind`` when present;
- pausing: ``pause_generation(mode=...)`` (0.22+) or its older ``wait_for_inflight_requests``
  form, or none at all (then the adapter's own abort/drain is the only pause);
- sampled-token log-probs: ``FlatLogprobs`` (flat lists) or a list of ``{token: Logprob}``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any

from megatron_darl.rollout.config import EngineConfig, SamplingConfig

log = logging.getLogger(__name__)
SUPPORTED = ((0, 20), (0, 27))  # [lower, upper) of the supported release range
_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
EXTENSION = "megatron_darl.rollout.engines.vllm_worker.DarlWorkerExtension"


def check_version(version: str) -> None:
    """Warn (once, at engine start) when the installed release is outside the supported range."""
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor is None or not SUPPORTED[0] <= major_minor < SUPPORTED[1]:
        log.warning("vLLM %s is outside the supported range >=0.20,<0.27; the adapter feature-detects "
                    "what it uses, but this release was not tested", version)


def engine_args(cfg: EngineConfig, seed: int = 0) -> Any:
    """``AsyncEngineArgs`` for ``cfg``, with only the fields the installed release knows."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    if cfg.dtype not in _DTYPES:
        raise ValueError(f"EngineConfig.dtype must be auto|bf16|fp16|fp32, got {cfg.dtype!r}")
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for needed in ("logprobs_mode", "worker_extension_cls"):
        if needed not in fields:
            raise RuntimeError(f"this vLLM's AsyncEngineArgs has no {needed!r}: the vllm backend needs "
                               "vllm>=0.20 (processed log-probs and the weight hand-over)")
    wanted = dict(
        model=cfg.model_path, dtype=_DTYPES[cfg.dtype], tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization, max_num_seqs=cfg.max_batch_size,
        enable_prefix_caching=True, enforce_eager=not cfg.compile, seed=seed,
        logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled
        worker_extension_cls=EXTENSION, disable_log_stats=True, enable_log_requests=False,
        disable_log_requests=True,  # the older spelling; only one of the two exists
    )
    if cfg.max_model_len:
        wanted["max_model_len"] = cfg.max_model_len
    unknown = sorted(set(cfg.vllm_args) - fields)
    if unknown:
        raise ValueError(f"EngineConfig.vllm_args: {unknown} are not fields of this vLLM's AsyncEngineArgs")
    wanted.update(cfg.vllm_args)
    return AsyncEngineArgs(**{k: v for k, v in wanted.items() if k in fields})


def start_kwargs(engine_cls: Any) -> dict:
    """Keyword arguments of ``engine_cls.from_engine_args`` beyond the engine arguments.

    Rollouts are offline throughput work, so the engine takes vLLM's ``LLM``-class defaults, not
    those of a bare engine context: on an H100 that raises ``max_num_batched_tokens`` from 2048 to
    16384 (prefill in one chunk instead of eight; 1.7B, 256 x 256 tokens: 15.6k -> 20.3k tokens/s).
    """
    try:
        from vllm.usage.usage_lib import UsageContext
    except ImportError:  # pragma: no cover - a release without usage contexts
        return {}
    params = inspect.signature(engine_cls.from_engine_args).parameters
    if "usage_context" not in params or not hasattr(UsageContext, "LLM_CLASS"):
        return {}
    return {"usage_context": UsageContext.LLM_CLASS}


def token_prompt(ids: list[int]) -> Any:
    """The engine input for a tokenized prompt on the installed release."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:
        return {"prompt_token_ids": ids}
    return tokens_input(ids)


@functools.lru_cache(maxsize=1)
def _params_fields() -> frozenset[str]:
    from vllm import SamplingParams

    fields = getattr(SamplingParams, "__struct_fields__", None)  # msgspec.Struct
    return frozenset(fields) if fields else frozenset(inspect.signature(SamplingParams).parameters)


def sampling_params(sampling: SamplingConfig, max_tokens: int, stop_token_ids: list[int]) -> Any:
    """``SamplingParams`` for one response (n = 1) of at most ``max_tokens`` new tokens."""
    from vllm import SamplingParams

    fields = _params_fields()
    kwargs: dict[str, Any] = dict(
        n=1, max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1, logprobs=0, detokenize=False,
        stop_token_ids=sorted(set(stop_token_ids) | set(sampling.stop_token_ids)),
        ignore_eos=sampling.ignore_eos,
    )
    if "flat_logprobs" in fields:
        kwargs["flat_logprobs"] = True  # a few flat lists per response instead of one dict per token
    if "output_kind" in fields:
        from vllm.sampling_params import RequestOutputKind

        kwargs["output_kind"] = RequestOutputKind.FINAL_ONLY  # one output per request
    return SamplingParams(**{k: v for k, v in kwargs.items() if k in fields})


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token (``SamplingParams(logprobs=0)``), in order."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs although logprobs=0 was requested")
    flat_values = getattr(logprobs, "logprobs", None)
    if isinstance(flat_values, list) and hasattr(logprobs, "start_indices"):  # FlatLogprobs
        starts, flat_ids = logprobs.start_indices, logprobs.token_ids
        if len(flat_values) == len(token_ids) and list(flat_ids) == list(token_ids):
            return [float(x) for x in flat_values]  # one entry per position: the sampled token
        out = []
        for pos, tok in enumerate(token_ids):
            lo, hi = starts[pos], logprobs.end_indices[pos]
            match = [i for i in range(lo, hi) if flat_ids[i] == tok]
            if not match:
                raise RuntimeError(f"vLLM returned no log-prob for sampled token {tok} at position {pos}")
            out.append(float(flat_values[match[0]]))
        return out
    return [float(step[tok].logprob) for tok, step in zip(token_ids, logprobs)]


def pause_kwargs(llm: Any) -> dict[str, Any] | None:
    """Keyword arguments of ``AsyncLLM.pause_generation`` that abort nothing of ours (we abort or
    drain first) and clear the caches; ``None`` when the release has no pause."""
    pause = getattr(llm, "pause_generation", None)
    if pause is None:
        return None
    params = inspect.signature(pause).parameters
    kwargs: dict[str, Any] = {}
    if "mode" in params:
        kwargs["mode"] = "abort"  # nothing of ours is running; stray requests must not survive
    elif "wait_for_inflight_requests" in params:
        kwargs["wait_for_inflight_requests"] = False
    if "clear_cache" in params:
        kwargs["clear_cache"] = True
    return kwargs
