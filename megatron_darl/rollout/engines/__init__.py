"""Engine backends behind one contract (``base.Engine``) and the ``build_engine`` factory."""

from megatron_darl.rollout.engines.base import Engine, EngineConfig, Generation, SamplingConfig


def build_engine(cfg: EngineConfig) -> Engine:
    """The engine named by ``cfg.backend`` (``hf`` or ``vllm``); vLLM is imported only when asked."""
    if cfg.backend == "hf":
        from megatron_darl.rollout.engines.hf import HFEngine

        return HFEngine(cfg)
    if cfg.backend == "vllm":
        from megatron_darl.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(cfg)
    raise ValueError(f"EngineConfig.backend must be 'hf' or 'vllm', got {cfg.backend!r}")


__all__ = ["Engine", "EngineConfig", "Generation", "SamplingConfig", "build_engine"]
