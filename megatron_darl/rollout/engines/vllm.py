"""The ``vllm`` rollout backend: a thin adapter over vLLM's offline Python API (``vllm>=0.10,<0.12``).

UNVERIFIED HERE: vLLM cannot run on our CPU CI or our GPU machine; this file is written against
vLLM's documented API and exercised only by ``tests/gpu/test_vllm_backend.py`` wherever vLLM
imports. Everything around it (worker, channel, weight sync) is tested with the ``hf`` backend
through the same ``Engine`` contract.

- Generation: ``LLM.generate(prompts=[{"prompt_token_ids": ...}], SamplingParams(n, logprobs=0))``;
  ``logprobs=0`` returns exactly the sampled token's log-prob per position.
- Log-prob semantics: the engine is built with ``logprobs_mode="processed_logprobs"`` so the
  value is under the distribution actually sampled from (after temperature/top-k/top-p), the same
  as the ``hf`` backend; at temperature 1 with no truncation this equals the trainer's
  temperature-1 recomputation. vLLM versions without that option return raw (temperature-1)
  log-probs; the adapter then logs a warning once.
- Weights: HF-named tensors go to the model's own ``load_weights`` (which fuses q/k/v and
  gate/up itself), in place. In-process engine core (launch sets
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): called directly on the driver worker's model, no copy.
  Otherwise via ``LLM.collective_rpc``, which pickles the tensors to the engine process (slower).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from megatron_darl.rollout.engines.base import EngineConfig, Generation, SamplingConfig

log = logging.getLogger(__name__)
_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _load_on_worker(worker: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (``collective_rpc``): load into that worker's model."""
    worker.model_runner.model.load_weights(weights=named)


class VLLMEngine:
    """Generation with ``vllm.LLM``; see the module docstring for what is and is not verified."""

    def __init__(self, cfg: EngineConfig) -> None:
        try:
            import vllm
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise ImportError("EngineConfig.backend='vllm' needs vLLM: pip install '.[vllm]'") from exc
        if not cfg.model_path:
            raise ValueError("EngineConfig.model_path is empty: the vllm backend needs a checkpoint")
        if cfg.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be auto|bf16|fp16|fp32, got {cfg.dtype!r}")
        self._vllm, self.cfg = vllm, cfg
        kwargs = dict(model=cfg.model_path, dtype=_DTYPES[cfg.dtype], tensor_parallel_size=cfg.tensor_parallel_size,
                      gpu_memory_utilization=cfg.gpu_memory_utilization, max_num_seqs=cfg.max_batch_size,
                      enable_prefix_caching=True)
        try:
            self.llm = vllm.LLM(**kwargs, logprobs_mode="processed_logprobs")
            self.processed_logprobs = True
        except TypeError:
            log.warning("this vLLM has no logprobs_mode: log-probs are raw (temperature 1, untruncated)")
            self.llm = vllm.LLM(**kwargs)
            self.processed_logprobs = False

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Generation]]:
        """``sampling.n`` responses per prompt with the sampled tokens' log-probs."""
        params = self._vllm.SamplingParams(
            n=sampling.n, max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids), logprobs=0,
        )
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [[self._one(c) for c in out.outputs] for out in outputs]

    @staticmethod
    def _one(completion: Any) -> Generation:
        ids = list(completion.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(ids, completion.logprobs or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
        reason = "length" if completion.finish_reason == "length" else "stop"
        return Generation(token_ids=torch.tensor(ids, dtype=torch.int64),
                          logprobs=torch.tensor(logprobs, dtype=torch.float32), finish_reason=reason)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named full tensors into the running model, in place (vLLM fuses/shards them)."""
        named = list(named_tensors)
        model = self._driver_model()
        if model is not None:
            model.load_weights(weights=named)
        else:
            self.llm.collective_rpc(_load_on_worker, args=([(n, t.cpu()) for n, t in named],))
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused

    def _driver_model(self) -> Any:
        """The model object when the engine core runs in this process, else None."""
        try:
            worker = self.llm.llm_engine.model_executor.driver_worker
            worker = getattr(worker, "worker", worker)
            return worker.model_runner.model
        except AttributeError:
            return None

    def close(self) -> None:
        self.llm = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
