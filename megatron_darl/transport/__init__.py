"""Rendezvous, sample channel, weight broadcast and heartbeats between trainer and rollout.

The trainer imports this package (never ``rollout``); rollout workers import it too. Control
meets over one TCPStore served by trainer rank 0 (``serve_store``/``connect_store``), beside the
run's ledger, which keeps the staleness counters and takes only authenticated requests
(``ledger``; the bound's policy is ``staleness``); data moves
on standalone data-plane groups (``process_group``): a pair group per (worker, hub) for sample
payloads (``channel``, ``links``), a broadcast group per PP stage for weights (``weight_sync``),
or CUDA IPC handles (``cuda_ipc``) for a worker on its leader's GPU.

Names are imported on first use (PEP 562): the run config reads ``config`` and ``shape`` in every
process, the launcher's included, and that must not pull in torch with the channel.
"""

from __future__ import annotations

from megatron_darl.lazy import lazy_exports

_HOMES = {
    "SampleHub": "channel", "SampleSender": "channel",
    "ChannelConfig": "config", "ControlPlaneConfig": "config", "HeartbeatConfig": "config",
    "TransportConfig": "config", "WeightSyncConfig": "config",
    "GroupFrame": "frames", "GroupMeta": "frames", "ReceivedGroup": "frames", "frame_group": "frames",
    "unframe_group": "frames",
    "Heartbeat": "heartbeat", "PeerLoss": "heartbeat",
    "DataPlaneGroup": "process_group", "build_group": "process_group",
    "StalenessBound": "shape", "Topology": "shape",
    "StalenessGate": "staleness", "StartTicket": "staleness", "release_reservations": "staleness",
    "MemberInfo": "store", "TRAINER": "store", "TransportTimeout": "store", "WORKER": "store",
    "connect_store": "store", "post_exit": "store", "published_version": "store", "register": "store",
    "request_stop": "store", "serve_store": "store", "stop_requested": "store", "wait_for_exits": "store",
    "WeightReceiver": "weight_receiver",
    "SyncReport": "weight_sync", "WeightLoadError": "weight_sync", "WeightSender": "weight_sync",
    "WeightSyncFailed": "weight_sync",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOMES, globals())
