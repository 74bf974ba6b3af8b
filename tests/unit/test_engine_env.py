"""``launch.engine_env``: the variables a vLLM rollout worker gets, and that the user's win."""

from launch.engine_env import apply_engine_env, engine_env
from megatron_darl.rollout.config import EngineConfig


def test_vllm_gets_its_environment_and_user_values_win(tmp_path):
    assert engine_env(EngineConfig(backend="hf", model_path=str(tmp_path))) == {}
    local = EngineConfig(backend="vllm", model_path=str(tmp_path))
    assert engine_env(local) == {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
                                 "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HF_HUB_OFFLINE": "1"}
    assert "HF_HUB_OFFLINE" not in engine_env(EngineConfig(backend="vllm", model_path="Qwen/Qwen3-1.7B"))
    environ = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert apply_engine_env(local, environ)["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    assert environ["VLLM_NO_USAGE_STATS"] == "1" and environ["HF_HUB_OFFLINE"] == "1"
