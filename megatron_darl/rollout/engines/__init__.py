"""Engine backends behind one contract (``base.Engine``) and the ``build_engine`` factory."""

from megatron_darl.rollout.config import EngineConfig
from megatron_darl.rollout.engines.base import Engine, Generation


def build_engine(cfg: EngineConfig) -> Engine:
    """The engine named by ``cfg.backend`` (``hf`` or ``vllm``); vLLM is imported only when asked."""
    if cfg.backend == "hf":
        from megatron_darl.rollout.engines.hf import HFEngine  # keeps transformers off until asked

        return HFEngine(cfg)
    if cfg.backend == "vllm":
        from megatron_darl.rollout.engines.vllm import VLLMEngine  # defers vLLM, an optional dependency

        return VLLMEngine(cfg)
    raise ValueError(f"EngineConfig.backend must be 'hf' or 'vllm', got {cfg.backend!r}")


__all__ = ["Engine", "Generation", "build_engine"]
