"""The run's one typed config: ``RunConfig``, made of the components' own dataclasses.

Every process of a run (trainer ranks, rollout workers, the launcher) holds the same
``RunConfig``; the loop types its argument with it (``trainer_loop``, ``rollout_loop``).
Composition from ``configs/`` is Hydra's job in ``launch/config.py``, which registers this class
as the structured schema every preset is checked against and converts the composed config to it
once; nothing here knows Hydra. ``check_consistent`` holds the cross-component checks, each
``ValueError`` naming both fields.

A number several components share is stated once: the staleness bound in ``algorithm.*`` (eta,
B; G too), the topology in ``cluster.*`` and ``parallel.*``. ``bound`` and ``topology`` derive
the plain values (``transport.shape``) that the transport, the worker and the loop take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_darl.data.config import DataConfig
from megatron_darl.eval.config import PeriodicEvalConfig
from megatron_darl.loop.config import LoopConfig, ModelConfig, density_temperature
from megatron_darl.models.config import WarmStartConfig
from megatron_darl.rewards.config import RewardConfig
from megatron_darl.rollout.config import EngineConfig, ResponseSamplingConfig, RolloutWorkerConfig
from megatron_darl.step.config import AlgorithmConfig, ReplayConfig
from megatron_darl.trainer.config import ParallelConfig, TrainerConfig
from megatron_darl.transport.config import TransportConfig
from megatron_darl.transport.shape import StalenessBound, Topology

ROLLOUT_FAILURE = ("continue", "abort")


@dataclass
class SplitRatesConfig:
    """Rates ``cluster.split=auto`` chooses the trainer:rollout split from (``launch/split.py``).

    0 = unknown: then the newest matching ``benchmarks/results/loop_profile_*.json`` records, else
    a FLOPs prior. One engine's generation seconds per step are modelled as ``max_new_tokens x
    (engine_decode_s + engine_decode_s_per_sample x samples it generates per step)``.
    """

    trainer_tokens_per_s: float = 0.0  # train-step tokens/s of ONE trainer GPU (T GPUs: T times it)
    trainer_work: float = 0.0  # trainer busy seconds per step / train-step seconds (darl scores candidates)
    engine_decode_s: float = 0.0  # one engine's seconds per decode step whatever its batch (weights read)
    engine_decode_s_per_sample: float = 0.0  # added per sequence in the engine's batch, per decode step
    prompt_tokens: int = 0  # mean prompt tokens per sample; 0 = assumed (launch/split.py PROMPT_TOKENS)
    results_dir: str = ""  # where loop_profile records are read; "" = benchmarks/results of this checkout

    def __post_init__(self) -> None:
        for name in ("trainer_tokens_per_s", "trainer_work", "engine_decode_s",
                     "engine_decode_s_per_sample", "prompt_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster.rates.{name} must be >= 0 (0: unknown), got {getattr(self, name)}")


@dataclass
class ClusterConfig:
    """How ``launch.train`` lays the roles out on one machine (``configs/cluster/*.yaml``).

    Device lists are CUDA ordinals given to each role through ``CUDA_VISIBLE_DEVICES``; ``[]``
    hides every GPU (CPU run); ``null`` means auto: GPU 0 for the trainer when there is a GPU,
    and for rollout GPU 1 when there are two, GPU 0 (shared) when there is one. GPU counts
    (``trainer_gpus``, ``rollout_gpus``; ``configs/cluster/gpu4.yaml``) set the ranks, the workers
    and both device lists at once (``launch/config.py``): trainer ranks on GPUs 0..T-1, one rollout
    worker on each of the next R. ``split`` sets both counts at once: ``"T:R"``, or ``"auto"``
    (``launch/split.py`` picks them from ``rates`` and logs why; the saved config holds the
    resolved ``"T:R"``, so child processes never decide again).
    """

    split: str = ""  # "" = the counts below as given; "T:R"; "auto" = chosen from measured rates
    trainer_gpus: int = 0  # > 0: trainer ranks on GPUs 0..trainer_gpus-1 (sets the two fields below)
    rollout_gpus: int = 0  # > 0: one rollout worker per GPU after the trainer's (sets workers, devices)
    trainer_ranks: int = 1  # trainer processes (TP x PP x DP), one per device on GPU
    rollout_workers: int = 1  # rollout worker processes (one engine each)
    trainer_devices: Optional[list[int]] = None  # CUDA ordinals of trainer ranks; [] = CPU
    rollout_devices: Optional[list[int]] = None  # CUDA ordinals of rollout workers; [] = CPU
    master_addr: str = "127.0.0.1"  # torch.distributed rendezvous host of the trainer ranks
    master_port: int = 0  # torch.distributed rendezvous port; 0 = a free one (the store: transport's)
    threads_per_process: int = 0  # OMP/torch threads per child; 0 = cores / processes
    rollout_failure: str = "continue"  # a dead worker: "continue" with the others, or "abort"
    rollout_restarts: int = 1  # times launch.train starts a worker that died (a signal, a crash) again, per worker
    grace_s: float = 30.0  # after SIGTERM, seconds before children are killed
    rates: SplitRatesConfig = field(default_factory=SplitRatesConfig)  # inputs of split="auto"

    def __post_init__(self) -> None:
        for name in ("trainer_ranks", "rollout_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be >= 1, got {getattr(self, name)}")
        if self.split not in ("", "auto") and not _is_split(self.split):
            raise ValueError(f"cluster.split={self.split!r}: use '' (the counts), 'T:R' (e.g. '2:2') or 'auto'")
        if self.trainer_gpus < 0 or self.rollout_gpus < 0:
            raise ValueError(f"cluster.trainer_gpus={self.trainer_gpus} and cluster.rollout_gpus="
                             f"{self.rollout_gpus} must be >= 0 (0: not given by GPU count)")
        if self.rollout_failure not in ROLLOUT_FAILURE:
            raise ValueError(f"cluster.rollout_failure={self.rollout_failure!r}: use one of {ROLLOUT_FAILURE}")
        if self.rollout_restarts < 0:
            raise ValueError(f"cluster.rollout_restarts must be >= 0 (0: never), got {self.rollout_restarts}")
        if self.grace_s < 0 or self.threads_per_process < 0:
            raise ValueError("cluster.grace_s and cluster.threads_per_process must be >= 0")


def _is_split(text: str) -> bool:
    """``"T:R"`` with T, R >= 1 (the form ``launch/config.py`` leaves after resolving a split)."""
    parts = text.split(":")
    return len(parts) == 2 and all(p.strip().isdigit() and int(p) >= 1 for p in parts)


@dataclass
class RunConfig:
    """Everything one run needs; the same object in every process of the run."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # variant and PPO knobs
    replay: ReplayConfig = field(default_factory=ReplayConfig)  # window K, warmup, replays
    loop: LoopConfig = field(default_factory=LoopConfig)  # steps, run dir, logging, checkpoints
    model: ModelConfig = field(default_factory=ModelConfig)  # initial policy
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)  # embedded default policy
    data: DataConfig = field(default_factory=DataConfig)  # prompts and reward task
    reward: RewardConfig = field(default_factory=RewardConfig)  # verifier settings, reward.fn (own reward)
    engine: EngineConfig = field(default_factory=EngineConfig)  # rollout backend
    sampling: ResponseSamplingConfig = field(default_factory=ResponseSamplingConfig)  # G: algorithm.group_size
    worker: RolloutWorkerConfig = field(default_factory=RolloutWorkerConfig)  # rollout worker knobs
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # optimisation, batching
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TP/PP layout
    transport: TransportConfig = field(default_factory=TransportConfig)  # store, channel, weight sync
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # local process layout
    eval: PeriodicEvalConfig = field(default_factory=PeriodicEvalConfig)  # held-out points while training

    def __post_init__(self) -> None:
        check_consistent(self)

    @property
    def dp_size(self) -> int:
        return self.cluster.trainer_ranks // (self.parallel.tp * self.parallel.pp)

    @property
    def bound(self) -> StalenessBound:
        """The staleness bound (eta, B), from ``algorithm.*``: what the gate, hubs and workers enforce."""
        return StalenessBound(self.algorithm.max_staleness, self.algorithm.groups_per_step)

    @property
    def topology(self) -> Topology:
        """Rollout workers, DP hubs and PP stages, from ``cluster.*`` and ``parallel.*``."""
        return Topology(workers=self.cluster.rollout_workers, hubs=self.dp_size, stages=self.parallel.pp)


def check_consistent(cfg: RunConfig) -> None:
    """Cross-component checks: each ValueError names both fields."""
    _check_sampling(cfg.sampling)
    if cfg.eval.enabled and cfg.eval.worker >= cfg.cluster.rollout_workers:
        raise ValueError(f"eval.worker={cfg.eval.worker} must be below cluster.rollout_workers="
                         f"{cfg.cluster.rollout_workers} (the rollout worker that evaluates)")
    mp = cfg.parallel.tp * cfg.parallel.pp
    if cfg.cluster.trainer_ranks % mp:
        raise ValueError(f"cluster.trainer_ranks={cfg.cluster.trainer_ranks} is not a multiple of "
                         f"parallel.tp x parallel.pp = {mp}")
    dp = cfg.cluster.trainer_ranks // mp
    if cfg.algorithm.groups_per_step < dp:
        raise ValueError(f"algorithm.groups_per_step={cfg.algorithm.groups_per_step} must be at "
                         f"least the DP size {dp} (each DP rank trains at least one group a step)")
    # the trainer scores the sampler's density: refuses truncated sampling (names the fields)
    density_temperature(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k)


def _check_sampling(s) -> None:
    """Values the engines would only reject in a child process (or silently misuse)."""
    for name, ok, rule in (("max_new_tokens", s.max_new_tokens >= 1, ">= 1"),
                           ("temperature", s.temperature >= 0, ">= 0 (0: greedy)"),
                           ("top_p", 0 < s.top_p <= 1, "in (0, 1]"),
                           ("top_k", s.top_k == -1 or s.top_k >= 1, ">= 1, or -1 (off)")):
        if not ok:
            raise ValueError(f"sampling.{name}={getattr(s, name)} must be {rule}")
