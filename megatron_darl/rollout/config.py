"""Configs of the rollout side: how responses are sampled, which engine runs, one worker's knobs.

Every process converts the composed config to ``RunConfig``; these dataclasses are what it needs
of rollout, so this module imports nothing but the standard library (no engine, no torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

WEIGHT_TRANSFERS = ("ipc", "copy")


@dataclass
class ResponseSamplingConfig:
    """How each response is sampled: the run's ``sampling.*`` (G is ``algorithm.group_size``)."""

    max_new_tokens: int = 512  # length limit of one response
    temperature: float = 1.0  # softmax temperature; 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # -1 disables top-k
    seed: int = 0  # base seed; engines derive per-request seeds from it
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS
    ignore_eos: bool = False  # benchmarks: EOS does not stop a response (fixed-length generations)


@dataclass
class SamplingConfig(ResponseSamplingConfig):
    """How an engine samples: ``n`` responses per prompt, each as ``ResponseSamplingConfig`` says."""

    n: int = 1  # responses per prompt (the GRPO group size G)

    @classmethod
    def group(cls, sampling: ResponseSamplingConfig, n: int) -> SamplingConfig:
        """``n`` responses per prompt, sampled as ``sampling`` says (the run's: n = G)."""
        return cls(n=n, **asdict(sampling))


@dataclass
class EngineConfig:
    """Which backend runs generation, on what."""

    backend: str = "hf"  # "hf" (transformers generate) or "vllm"
    model_path: str = ""  # Hugging Face checkpoint directory
    dtype: str = "auto"  # "auto" (hf: bf16 on GPU, fp32 on CPU; vllm: the checkpoint's), "bf16", "fp16", "fp32"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N" (vllm: the visible GPUs, set by launch)
    max_batch_size: int = 64  # sequences generated together (vllm: max_num_seqs)
    compile: bool = True  # hf: static cache + torch.compile on GPU; vllm: False = enforce_eager
    tensor_parallel_size: int = 1  # vllm: engine TP size
    gpu_memory_utilization: float = 0.85  # vllm: fraction of GPU memory for weights + KV cache
    max_model_len: int = 0  # vllm: longest prompt + response; 0 = the checkpoint's limit
    weight_transfer: str = "ipc"  # vllm: weights into the engine process by "ipc" (CUDA IPC) or "copy"
    timeout_s: float = 600.0  # vllm: longest wait on one engine operation (start, pause, weight load)
    vllm_args: dict[str, Any] = field(default_factory=dict)  # vllm: extra AsyncEngineArgs fields

    def __post_init__(self) -> None:
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"EngineConfig.weight_transfer must be one of {WEIGHT_TRANSFERS}, "
                             f"got {self.weight_transfer!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.max_batch_size < 1 or self.tensor_parallel_size < 1 or self.max_model_len < 0:
            raise ValueError("EngineConfig.max_batch_size and tensor_parallel_size must be >= 1, "
                             "max_model_len >= 0")
        if self.timeout_s <= 0:
            raise ValueError(f"EngineConfig.timeout_s must be > 0, got {self.timeout_s}")



UPDATE_MODES = ("finish", "interrupt")


@dataclass
class RolloutWorkerConfig:
    """One rollout worker."""

    worker_id: int = 0  # rank among rollout workers (0..num_workers-1)
    groups_per_batch: int = 8  # prompt groups per engine call of a batch engine (hf); see max_inflight
    max_inflight: int = 0  # groups submitted and not yet finished at once; 0 = groups_per_batch
    update_mode: str = "finish"  # groups in flight at a weight sync: "finish" on the old weights, or "interrupt"
    chunk_tokens: int = 0  # batch engines: new tokens per engine call (a safe point between); 0 = whole responses
    reward_threads: int = 4  # threads computing rewards off the engine's critical path
    idle_sleep_s: float = 0.01  # sleep when the staleness bound or a sync blocks generation
    initial_version: int = 0  # version of the engine's starting weights (-1: wait for a sync)

    def __post_init__(self) -> None:
        if self.worker_id < 0:
            raise ValueError(f"RolloutWorkerConfig.worker_id must be >= 0, got {self.worker_id}")
        if self.groups_per_batch < 1 or self.reward_threads < 1:
            raise ValueError("RolloutWorkerConfig.groups_per_batch and reward_threads must be >= 1")
        if self.max_inflight < 0 or self.chunk_tokens < 0:
            raise ValueError("RolloutWorkerConfig.max_inflight and chunk_tokens must be >= 0")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"RolloutWorkerConfig.update_mode must be one of {UPDATE_MODES}, "
                             f"got {self.update_mode!r}")

    @property
    def inflight_limit(self) -> int:
        """Groups the engine works on at once (the batch of a batch engine)."""
        return self.max_inflight or self.groups_per_batch
