"""Rendezvous, sample channel, weight broadcast and heartbeats between trainer and rollout.

The trainer imports this package (never ``rollout``); rollout workers import it too. Control
meets over one TCPStore served by trainer rank 0 (``serve_store``/``connect_store``), beside the
run's ledger, which keeps the staleness counters and takes only authenticated requests
(``ledger``; the bound's policy is ``staleness``); data moves
on standalone data-plane groups (``process_group``): a pair group per (worker, hub) for sample
payloads (``channel``, ``links``), a broadcast group per PP stage for weights (``weight_sync``),
or CUDA IPC handles (``cuda_ipc``) for a worker on its leader's GPU.
"""

from megatron_darl.transport.channel import SampleHub, SampleSender
from megatron_darl.transport.config import (
    ChannelConfig, ControlPlaneConfig, HeartbeatConfig, TransportConfig, WeightSyncConfig,
)
from megatron_darl.transport.frames import GroupFrame, GroupMeta, ReceivedGroup, frame_group, unframe_group
from megatron_darl.transport.heartbeat import Heartbeat, PeerLoss
from megatron_darl.transport.process_group import DataPlaneGroup, build_group
from megatron_darl.transport.shape import StalenessBound, Topology
from megatron_darl.transport.staleness import StalenessGate, StartTicket, release_reservations
from megatron_darl.transport.store import (
    TRAINER, WORKER, MemberInfo, TransportTimeout, connect_store, post_exit, published_version, register,
    request_stop, serve_store, stop_requested, wait_for_exits,
)
from megatron_darl.transport.weight_receiver import WeightReceiver
from megatron_darl.transport.weight_sync import SyncReport, WeightLoadError, WeightSender, WeightSyncFailed

__all__ = [
    "ChannelConfig", "ControlPlaneConfig", "DataPlaneGroup", "GroupFrame", "GroupMeta", "Heartbeat",
    "HeartbeatConfig", "MemberInfo", "PeerLoss", "ReceivedGroup", "SampleHub",
    "SampleSender", "StalenessBound", "StalenessGate", "StartTicket", "SyncReport", "TRAINER", "TransportConfig",
    "Topology", "TransportTimeout", "WORKER", "WeightLoadError", "WeightReceiver", "WeightSender", "WeightSyncConfig",
    "WeightSyncFailed", "build_group",
    "connect_store", "frame_group", "post_exit", "published_version", "register",
    "release_reservations",
    "request_stop", "serve_store", "stop_requested", "unframe_group", "wait_for_exits",
]
