"""The ``hf`` rollout backend: transformers ``generate`` with the engine's own sampled-token log-probs.

It is the embedded default and the test engine (vLLM cannot run on CPU CI), so it receives the
same HF-named weights through the same weight-sync path as vLLM (``load_weights``: in-place copy).

Log-prob semantics: every returned log-prob is log p(token) under the distribution the token was
actually sampled from, i.e. ``log_softmax`` of the logits after temperature scaling and top-k /
top-p truncation. With temperature 1, top_k -1 and top_p 1 (the RL default) that is exactly
``log_softmax(logits)``, what the trainer recomputes at temperature 1. Greedy (temperature 0)
reports the temperature-1 log-prob of the argmax token. The warping is done by our own logits
processor (generate's own warpers are switched off) because transformers runs custom processors
before its warpers, and the recorder must see the final distribution.

On GPU with ``EngineConfig.compile`` the static KV cache is used, which makes transformers compile
the decoding forward with torch.compile; on CPU the dynamic cache runs eagerly.
"""

from __future__ import annotations

from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from megatron_darl.rollout.config import EngineConfig, SamplingConfig
from megatron_darl.rollout.engines.base import Generation

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 on GPU, fp32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"EngineConfig.dtype must be auto|bf16|fp16|fp32, got {dtype!r}")
    return _DTYPES[dtype]


class _WarpAndRecord(LogitsProcessor):
    """Apply temperature/top-k/top-p and record the log-prob of each token sampled from the result.

    At step t the newest input id is the token sampled at step t-1 from the scores seen then, so
    only one step of scores is ever kept (no (steps, B, V) buffer).
    """

    def __init__(self, sampling: SamplingConfig, max_new_tokens: int) -> None:
        self.s = sampling
        self.prev: torch.Tensor | None = None  # (B, V) float32 log-probs of the previous step
        self.logprobs: list[torch.Tensor] = []  # per step (B,) float32

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.collect(input_ids[:, -1])
        scores = scores.float()
        if self.s.temperature > 0:
            scores = scores / self.s.temperature
            if self.s.top_k > 0:
                kth = torch.topk(scores, min(self.s.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if self.s.top_p < 1.0:
                scores = _top_p(scores, self.s.top_p)
        self.prev = torch.log_softmax(scores, dim=-1)
        return scores

    def collect(self, tokens: torch.Tensor) -> None:
        if self.prev is not None:
            self.logprobs.append(self.prev.gather(-1, tokens[:, None].to(self.prev.device))[:, 0])
            self.prev = None


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, idx = torch.sort(scores, descending=True, dim=-1)
    cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    drop_sorted = (cum - torch.softmax(sorted_scores, dim=-1)) >= top_p  # mass before this token
    drop = drop_sorted.scatter(-1, idx, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


class HFEngine:
    """Generation with a transformers causal LM, batched over many groups."""

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module | None = None) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, self.device)
        if model is None:
            if not cfg.model_path:
                raise ValueError("EngineConfig.model_path is empty: the hf backend needs a checkpoint")
            model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self._tensors = self.model.state_dict()
        self._calls: dict[str, int] = {}  # generate batches so far, by sampling config (its seed stream)
        cfg_eos = self.model.config.eos_token_id
        self.eos_ids = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0] if self.eos_ids else 0

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Generation]]:
        """``sampling.n`` responses per prompt; chunks of ``max_batch_size`` sequences."""
        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.n and max_new_tokens must be >= 1, got {sampling.n}, {sampling.max_new_tokens}")
        flat = [p for p in prompts for _ in range(sampling.n)]
        gens: list[Generation] = []
        for lo in range(0, len(flat), self.cfg.max_batch_size):
            gens += self._generate_batch(flat[lo : lo + self.cfg.max_batch_size], sampling)
        return [gens[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must hold at least one token each")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        stops = ([] if sampling.ignore_eos else self.eos_ids) + list(sampling.stop_token_ids)
        recorder = _WarpAndRecord(sampling, sampling.max_new_tokens)
        gen_cfg = GenerationConfig(
            do_sample=sampling.temperature > 0, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=sampling.max_new_tokens, eos_token_id=stops or None, pad_token_id=self.pad_id,
            return_dict_in_generate=True,
        )
        if self.device.type == "cuda" and self.cfg.compile:
            gen_cfg.cache_implementation = "static"
        # each sampling config keeps its own seed sequence: an evaluation's generations (another
        # config, eval/periodic.py) leave the training stream's next seed where it was
        key = repr(sampling)
        calls = self._calls.get(key, 0)
        torch.manual_seed(sampling.seed + calls)
        self._calls[key] = calls + 1
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=gen_cfg,
            logits_processor=LogitsProcessorList([recorder]),
        )
        new = out.sequences[:, width:]
        recorder.collect(new[:, -1])
        logprobs = torch.stack(recorder.logprobs, dim=1).cpu() if recorder.logprobs else torch.zeros(len(prompts), 0)
        return [self._one(new[i].cpu(), logprobs[i], stops, sampling.max_new_tokens) for i in range(len(prompts))]

    @staticmethod
    def _one(tokens: torch.Tensor, logprobs: torch.Tensor, stops: list[int], limit: int) -> Generation:
        hits = torch.isin(tokens, torch.tensor(stops, dtype=tokens.dtype)).nonzero() if stops else []
        if len(hits):
            end, reason = int(hits[0]) + 1, "stop"
        else:
            end, reason = tokens.numel(), "length" if tokens.numel() >= limit else "stop"
        return Generation(token_ids=tokens[:end].clone(), logprobs=logprobs[:end].float().clone(), finish_reason=reason)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model in place (tied weights share storage)."""
        for name, tensor in named_tensors:
            dst = self._tensors.get(name)
            if dst is None:
                raise ValueError(f"load_weights: {name!r} is not a tensor of this model")
            if dst.shape != tensor.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, model has {tuple(dst.shape)}")
            dst.copy_(tensor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's HF-named tensors (what a weight sync overwrites)."""
        return self.model.state_dict()

    def close(self) -> None:
        self.model = None
        self._tensors = {}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
