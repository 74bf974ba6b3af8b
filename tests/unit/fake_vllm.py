"""A FAKE of the slice of vLLM's API that ``engines/vllm.py`` uses, for CPU tests only.

vLLM cannot run on our CPU machines (it pins torch 2.11 + CUDA), but the adapter's own logic
(asyncio thread, streaming groups, abort-and-continue at a weight load, per-token versions,
weights by ``collective_rpc`` into the worker extension) can be exercised against a stand-in with
the same call signatures and semantics as read from vLLM 0.22-0.26's source:

- ``AsyncLLM.from_engine_args``, ``generate(prompt, params, request_id)`` (async generator; with
  ``output_kind=FINAL_ONLY`` one final ``RequestOutput``), ``abort(ids)`` (the aborted request's
  final output carries its tokens so far, finish_reason "abort": ``OutputProcessor.abort_requests``),
  ``pause_generation(mode=, clear_cache=)``, ``resume_generation``, ``reset_prefix_cache``,
  ``collective_rpc(method, timeout, args)`` calling the extension method on the worker,
  ``shutdown``; ``model_config.hf_config`` / ``max_model_len``;
- the model is a real transformers model on CPU; each engine "step" samples one token for every
  running request from logits / T (top-k applied), and reports that processed log-prob.

The real path is exercised by ``tests/gpu/test_vllm_backend.py`` wherever vLLM imports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import importlib
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

_MSGPACK_NATIVE = (bytes, str, int, float, bool, type(None))


def _native(x) -> bool:
    if isinstance(x, (list, tuple)):
        return all(_native(v) for v in x)
    if isinstance(x, dict):
        return all(isinstance(k, str) and _native(v) for k, v in x.items())
    return isinstance(x, _MSGPACK_NATIVE)


@dataclass
class AsyncEngineArgs:
    model: str = ""
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    max_model_len: int | None = None
    logprobs_mode: str = "raw_logprobs"
    worker_extension_cls: str = ""
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    load_format: str = "auto"


class UsageContext(enum.Enum):  # vllm.usage.usage_lib
    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    logprobs: int | None = None
    detokenize: bool = True
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)


class _ModelAdapter:
    """What the worker's ``get_model()`` returns: ``load_weights`` copies HF-named tensors in place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.hf = model

    def load_weights(self, weights):
        params = dict(self.hf.state_dict())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


class _WorkerBase:
    def __init__(self, model) -> None:
        self.model = _ModelAdapter(model)

    def get_model(self):
        return self.model


class AsyncLLM:
    """The fake engine; see the module docstring."""

    instances: list["AsyncLLM"] = []

    def __init__(self, args: AsyncEngineArgs) -> None:
        import transformers

        self.args = args
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        module, _, name = args.worker_extension_cls.rpartition(".")
        ext = getattr(importlib.import_module(module), name)
        self.worker = type("FakeWorker", (_WorkerBase, ext), {})(self.hf)
        self.model_config = SimpleNamespace(hf_config=self.hf.config, max_model_len=args.max_model_len or 256)
        self.requests: dict[str, _Request] = {}
        self.paused = False
        self.calls: list[str] = []  # pause / resume / reset / rpc, in order
        self.steps = 0
        self.register_delay_s = 0.0  # > 0: a request reaches the engine this long after generate() starts
        self.generator = torch.Generator().manual_seed(args.seed)
        self._task = None
        AsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs,
                         usage_context: UsageContext = UsageContext.ENGINE_CONTEXT) -> "AsyncLLM":
        assert asyncio.get_running_loop() is not None
        engine = cls(args)
        engine.usage_context = usage_context  # picks the scheduler defaults (max_num_batched_tokens)
        return engine

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        assert params.output_kind is RequestOutputKind.FINAL_ONLY and params.logprobs == 0
        assert self.args.logprobs_mode == "processed_logprobs"
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        await asyncio.sleep(self.register_delay_s)
        req = _Request(request_id, list(prompt["prompt_token_ids"]), params, asyncio.Queue())
        self.requests[request_id] = req
        yield await req.queue.get()

    def _final(self, req: _Request, reason: str):
        out = SimpleNamespace(token_ids=list(req.tokens), logprobs=list(req.logprobs), finish_reason=reason)
        return SimpleNamespace(outputs=[out], finished=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.002)
            if self.paused or not self.requests:
                continue
            self.steps += 1
            for req in list(self.requests.values()):
                self._step(req)

    @torch.no_grad()
    def _step(self, req: _Request) -> None:
        p = req.params
        logits = self.hf(torch.tensor([req.prompt + req.tokens])).logits[0, -1].float()
        if p.temperature > 0:
            logits = logits / p.temperature
            if p.top_k > 0:
                kth = torch.topk(logits, p.top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
        logp = torch.log_softmax(logits, -1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=self.generator)) if p.temperature > 0 else int(logp.argmax())
        req.tokens.append(tok)
        req.logprobs.append({tok: SimpleNamespace(logprob=float(logp[tok]))})
        eos = self.hf.config.eos_token_id
        if tok in p.stop_token_ids or (tok == eos and not p.ignore_eos):
            reason = "stop"
        elif len(req.tokens) >= p.max_tokens:
            reason = "length"
        else:
            return
        del self.requests[req.rid]
        req.queue.put_nowait(self._final(req, reason))

    async def abort(self, request_id) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            req = self.requests.pop(rid, None)
            if req is not None:
                req.queue.put_nowait(self._final(req, "abort"))

    async def pause_generation(self, *, mode: str = "abort", wait_for_inflight_requests=None,
                               clear_cache: bool = True) -> None:
        assert mode == "abort" and not self.requests, "the adapter aborts its requests before pausing"
        self.paused = True
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.paused = False
        self.calls.append("resume")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append("reset")
        return True

    async def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs=None):
        assert isinstance(method, str) and _native(list(args)), "RPC arguments must be msgpack-native"
        self.calls.append(f"rpc:{method}")
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()


def install(monkeypatch) -> None:
    """Put the fake under ``vllm`` in ``sys.modules`` (undone by ``monkeypatch``)."""
    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.engine", "vllm.engine.arg_utils", "vllm.v1", "vllm.v1.engine", "vllm.v1.engine.async_llm",
        "vllm.sampling_params", "vllm.inputs", "vllm.inputs.engine", "vllm.usage", "vllm.usage.usage_lib")}
    modules["vllm"].__version__ = "0.26.0"
    modules["vllm"].SamplingParams = SamplingParams
    modules["vllm.engine.arg_utils"].AsyncEngineArgs = AsyncEngineArgs
    modules["vllm.v1.engine.async_llm"].AsyncLLM = AsyncLLM
    modules["vllm.sampling_params"].RequestOutputKind = RequestOutputKind
    modules["vllm.usage.usage_lib"].UsageContext = UsageContext
    modules["vllm.inputs.engine"].tokens_input = lambda ids: {"type": "token", "prompt_token_ids": list(ids)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    AsyncLLM.instances.clear()
    assert dataclasses.is_dataclass(AsyncEngineArgs)
