"""Environment variables a rollout engine needs, set by the launcher (only ``launch/`` sets them).

vLLM reads its settings from the environment, in the rollout worker's process and in the engine
processes it starts (which inherit it). What we set, and why:

- ``VLLM_USE_FLASHINFER_SAMPLER=0``: our engine asks for processed log-probs, which FlashInfer's
  sampler cannot return (vLLM then uses its PyTorch sampler anyway); and where FlashInfer is not
  installed (the GPU machine's kit), vLLM's worker fails at start without this.
- ``VLLM_NO_USAGE_STATS=1``: no usage reporting from cluster nodes.
- ``VLLM_WORKER_MULTIPROC_METHOD=spawn``: the engine core starts in a fresh process. vLLM forks by
  default and switches to spawn only when ``torch.cuda.is_initialized()``; but a plain
  ``torch.cuda.is_available()`` or ``device_count()`` (pytest skip marks, our GPU probes) already
  makes a fork unusable for CUDA without counting as initialized, and the forked engine then dies
  with "Cannot re-initialize CUDA in forked subprocess" (seen on the H100 with vLLM 0.26.0).
- ``HF_HUB_OFFLINE=1`` when the checkpoint is a local directory: no hub lookups (compute nodes
  often have no network, and a lookup then waits for a timeout).

Values already in the environment win (``setdefault``), so a user can override any of them.
Not set on purpose: ``VLLM_ENABLE_V1_MULTIPROCESSING`` (``AsyncLLM`` always runs the engine in
its own processes) and ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (weights go through our worker
extension by method name with msgpack-native arguments, no pickled functions).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping

from megatron_darl.rollout.config import EngineConfig

VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def engine_env(engine: EngineConfig) -> dict[str, str]:
    """The variables ``engine`` needs (empty for the ``hf`` backend)."""
    if engine.backend != "vllm":
        return {}
    env = dict(VLLM_ENV)
    if engine.model_path and Path(engine.model_path).is_dir():
        env["HF_HUB_OFFLINE"] = "1"
    return env


def apply_engine_env(engine: EngineConfig, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """``setdefault`` each of ``engine_env(engine)`` into ``environ`` (default ``os.environ``);
    returns what is in effect for them."""
    environ = os.environ if environ is None else environ
    for key, value in engine_env(engine).items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in engine_env(engine)}
