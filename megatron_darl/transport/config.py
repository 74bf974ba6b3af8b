"""Typed configs of the transport between trainer and rollout processes.

One small dataclass per concern so that the trainer, the rollout worker and the tests can each
take only what they use; ``TransportConfig`` bundles them for Hydra (``configs/rollout/``).
Defaults are production defaults; tests shrink the timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ControlPlaneConfig:
    """Where the TCPStore served by trainer rank 0 lives (who meets there: ``shape.Topology``)."""

    host: str = "127.0.0.1"  # host of trainer rank 0 (first trainer node under Slurm)
    bind: str = ""  # address the store listens on; "" = the one `host` resolves to; "0.0.0.0" = all
    port: int = 0  # TCPStore port on that host; 0 = the launcher picks a free one
    store_timeout_s: float = 300.0  # how long a process waits for the store to come up
    call_timeout_s: float = 30.0  # deadline of one store request (frozen or unreachable host)
    poll_interval_s: float = 0.005  # sleep between non-blocking store polls
    secret: str = field(default="", repr=False)  # per-run HMAC key; from the launcher, never saved

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"ControlPlaneConfig.port must be in [0, 65535], got {self.port}")
        for name in ("store_timeout_s", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ControlPlaneConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class HeartbeatConfig:
    """Liveness: every process posts a beat; monitors name a peer silent for ``timeout_s``."""

    interval_s: float = 1.0  # seconds between two beats of one process
    timeout_s: float = 10.0  # a peer with no new beat for this long is reported dead

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"HeartbeatConfig.interval_s must be > 0, got {self.interval_s}")
        if self.timeout_s <= 2 * self.interval_s:
            raise ValueError(
                f"HeartbeatConfig.timeout_s ({self.timeout_s}) must exceed 2 * interval_s ({self.interval_s})"
            )


CHANNEL_TRANSPORTS = ("dataplane", "store")


@dataclass
class ChannelConfig:
    """Sample channel rollout -> DP hub: payload path and back-pressure (the bound: ``shape``)."""

    max_unacked_per_hub: int = 8  # groups a worker may have handed over but not yet acked, per hub
    send_timeout_s: float = 600.0  # longest a worker waits for a hub to make room (back-pressure)
    transport: str = "dataplane"  # payloads: "dataplane" (a worker<->hub pair group) or "store"
    backend: str = "auto"  # data-plane pairs: "gloo", "nccl", or "auto" (nccl between distinct GPUs)
    connect_timeout_s: float = 60.0  # building one worker<->hub pair group (both ends wait)
    transfer_timeout_s: float = 120.0  # one group's payload on a pair; a stuck peer's pair is dropped

    def __post_init__(self) -> None:
        if self.max_unacked_per_hub < 1:
            raise ValueError(
                f"ChannelConfig.max_unacked_per_hub must be >= 1, got {self.max_unacked_per_hub}"
            )
        if self.transport not in CHANNEL_TRANSPORTS:
            raise ValueError(f"ChannelConfig.transport must be one of {CHANNEL_TRANSPORTS}, got {self.transport!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"ChannelConfig.backend must be auto|gloo|nccl, got {self.backend!r}")
        for name in ("connect_timeout_s", "transfer_timeout_s", "send_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ChannelConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class WeightSyncConfig:
    """Trainer PP-stage leaders -> all rollout workers, over the data-plane process groups."""

    backend: str = "auto"  # "gloo", "nccl", or "auto" (nccl when every member holds its own GPU)
    colocated: str = "ipc"  # a worker on the leader's GPU: "ipc" (CUDA IPC handles) or "gloo"
    bucket_bytes: int = 1 << 30  # target bytes per broadcast bucket (~1 GiB)
    join_timeout_s: float = 120.0  # how long a sender waits for live workers to reach a safe point
    gather_s: float = 0.05  # after the first worker is ready, how long others may join its broadcast
    collective_timeout_s: float = 300.0  # timeout of group construction and of every broadcast
    ack_timeout_s: float = 300.0  # how long the coordinator waits for every live worker's ack
    max_attempts: int = 3  # tries per worker and version when it fails mid-sync (it died, a timeout)
    # Publish from a background thread (weight_publisher.py): the trainer stages a packed copy of
    # the weights on its device and goes on; workers get the newest staged version at their safe
    # point. Used with one PP stage when two staged copies fit in background_max_bytes; else blocking.
    background: bool = True
    background_max_bytes: int = 16 << 30  # device bytes two staged copies of a stage may take

    @property
    def publish_bound_s(self) -> float:
        """The longest one publish may take: join, group and broadcasts per attempt, acks, slack."""
        return self.max_attempts * (self.join_timeout_s + self.collective_timeout_s) + self.ack_timeout_s + 60

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"WeightSyncConfig.backend must be auto|gloo|nccl, got {self.backend!r}")
        if self.colocated not in ("ipc", "gloo"):
            raise ValueError(f"WeightSyncConfig.colocated must be ipc|gloo, got {self.colocated!r}")
        if self.max_attempts < 1:
            raise ValueError(f"WeightSyncConfig.max_attempts must be >= 1, got {self.max_attempts}")
        if self.gather_s < 0:
            raise ValueError(f"WeightSyncConfig.gather_s must be >= 0, got {self.gather_s}")
        if self.bucket_bytes < 1:
            raise ValueError(f"WeightSyncConfig.bucket_bytes must be >= 1, got {self.bucket_bytes}")


@dataclass
class TransportConfig:
    """Everything the transport needs, as composed by Hydra from ``configs/rollout/``."""

    control: ControlPlaneConfig = field(default_factory=ControlPlaneConfig)  # store + world
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)  # liveness
    channel: ChannelConfig = field(default_factory=ChannelConfig)  # samples rollout -> hub
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)  # weights -> rollout
