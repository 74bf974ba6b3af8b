"""Typed configs of the run around the step: how long it goes, where it writes, which model.

Hydra composes these from ``configs/config.yaml``; ``launch/`` converts the composed config to
these dataclasses once, so the loop never sees a ``DictConfig``. The algorithm's own configs
(``AlgorithmConfig``, ``ReplayConfig``) live with the step, in ``megatron_darl/step/config.py``.
Every check a user can trip raises ``ValueError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

WANDB_MODES = ("disabled", "offline", "online")


def density_temperature(temperature: float, top_p: float, top_k: int) -> float:
    """The temperature the trainer's log-probs must use to match the sampler's density.

    The engines report log-probs of the processed distribution they sample from (logits / T,
    then top-k/top-p truncation). The trainer applies the temperature; truncation it does not
    reproduce, so a truncated sampler is refused here, naming the fields. Greedy decoding
    (T = 0) reports temperature-1 log-probs, so the trainer uses 1.
    """
    if top_p < 1.0 or top_k > 0:
        raise ValueError(
            f"sampling.top_p={top_p} / sampling.top_k={top_k}: truncated sampling is not supported "
            "for training (the trainer's log-probs would be of the untruncated distribution, the "
            "engine's of the truncated one); use top_p 1.0 and top_k -1"
        )
    if temperature < 0:
        raise ValueError(f"sampling.temperature must be >= 0, got {temperature}")
    return temperature if temperature > 0 else 1.0


@dataclass
class WandbConfig:
    """Weights & Biases logging; ``offline`` writes under the run dir without any network."""

    mode: str = "disabled"  # "disabled", "offline" or "online"
    project: str = "megatron_darl"  # W&B project
    entity: str = ""  # W&B entity (team); "" = the default
    name: str = ""  # run name; "" = the run dir's name

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"loop.wandb.mode={self.mode!r}: use one of {WANDB_MODES}")


@dataclass
class LoopConfig:
    """How long the run goes, where it writes, and how often it logs and checkpoints."""

    steps: int = 100  # optimizer steps to run
    run_dir: str = "runs/default"  # metrics.jsonl, tensorboard/, plot, summary, checkpoints
    log_interval: int = 1  # steps between console log lines (metrics are written every step)
    # steps between checkpoints; null = by time (checkpoint_overhead); 0 = only at the end and on SIGTERM
    checkpoint_interval: Optional[int] = None
    checkpoint_overhead: float = 0.015  # null interval: periodic saves' share of wall time (~67x a save apart)
    keep_checkpoints: int = 2  # newest complete checkpoints kept once a new one is; 0 = keep all
    save_at_end: bool = True  # false: no checkpoint after the last step (benchmarks; a stop still saves)
    # seconds a stop signal leaves before SIGKILL (Slurm's KillWait: the Slurm launcher sets it);
    # a checkpoint that takes over half of it is warned about (a scancel may then save nothing)
    stop_grace_s: Optional[float] = None
    resume: bool = False  # continue from the latest checkpoint in run_dir when there is one
    receive_timeout_s: float = 600.0  # longest wait for a step's groups before naming the workers
    # staleness studies: each step waits until every start the bound allows under the published
    # version arrived ((eta + 1) * B untrained groups held), so a variant that reads the buffer as
    # a queue (score oldest) trains data eta versions old on any hardware; one that takes the
    # freshest (fifo, warmup) trains the B groups of the step's own version, staleness 0. The
    # trainer idles while the workers fill the bound
    wait_for_bound: bool = False
    progress_bar: bool = True  # live tqdm bar (step, reward, staleness, tokens/s)
    tensorboard: bool = True  # write <run_dir>/tensorboard
    plot: bool = True  # write <run_dir>/progress.png at the end
    verbose: bool = False  # libraries' INFO logs and warnings too (Megatron's configs, Apex/TE notices)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # W&B (off by default)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form tags copied to summary.json

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"loop.steps must be >= 0, got {self.steps}")
        if self.log_interval < 1:
            raise ValueError(f"loop.log_interval must be >= 1, got {self.log_interval}")
        if self.checkpoint_interval is not None and self.checkpoint_interval < 0:
            raise ValueError(f"loop.checkpoint_interval must be >= 0 or null, got {self.checkpoint_interval}")
        if not 0 <= self.checkpoint_overhead < 1:
            raise ValueError(f"loop.checkpoint_overhead must be in [0, 1), got {self.checkpoint_overhead}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"loop.keep_checkpoints must be >= 0 (0 keeps all), got {self.keep_checkpoints}")
        if self.stop_grace_s is not None and self.stop_grace_s <= 0:
            raise ValueError(f"loop.stop_grace_s must be > 0 or null, got {self.stop_grace_s}")
        if self.receive_timeout_s <= 0:
            raise ValueError(f"loop.receive_timeout_s must be > 0, got {self.receive_timeout_s}")
        if not self.run_dir:
            raise ValueError("loop.run_dir must not be empty")


@dataclass
class ModelConfig:
    """Where the initial policy comes from (``configs/model/*.yaml`` give ``name`` + ``hf_config``).

    Resolution, in order: ``path`` (an HF checkpoint directory: weights, config, tokenizer);
    else ``hf_config`` (random init at that shape, benchmarks); else the embedded default, the
    warm-started tiny policy of ``launch.warmstart`` (built and cached on first use).
    """

    name: str = "tiny"  # label for logs and result tables
    path: str = ""  # HF checkpoint directory; "" = see above
    hf_config: dict[str, Any] = field(default_factory=dict)  # HF config.json fields (random init)

    @property
    def needs_warm_start(self) -> bool:
        return not self.path and not self.hf_config
