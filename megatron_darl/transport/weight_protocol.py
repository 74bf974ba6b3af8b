"""The records both ends of weight sync share: store keys, the sender's report, staged weights,
and the two failures. The protocol itself is described in ``weight_sync.py`` (the sender) and
``weight_receiver.py`` (a worker's end); this module keeps the vocabulary in one place so that
neither end imports the other's machinery.

Keys are per *offer*: one ``WeightSender.publish`` call, numbered from 1 by each stage leader
(every stage leader publishes the same sequence, so their numbers agree). An offer names the
weights version it brings at least; the same version may be offered again to a worker that
came (or restarted) after its rounds ended (``weight_publisher.py``), under a new offer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from megatron_darl.transport.buckets import BucketEntry

PackedBucket = tuple[list[BucketEntry], torch.Tensor]  # entries and their flat uint8 buffer


class SyncKeys:
    """Store keys of the weight-sync handshake (``offer``: the publish they belong to)."""

    @staticmethod
    def offer(stage: int) -> str:
        """JSON: the stage's current offer number and the version it brings (``offer_value``)."""
        return f"ws/offer/{stage}"

    @staticmethod
    def ready(offer: int, worker: int) -> str:
        return f"ws/{offer}/ready/{worker}"

    @staticmethod
    def failed(offer: int, worker: int) -> str:
        return f"ws/{offer}/failed/{worker}"

    @staticmethod
    def retry_ready(offer: int, stage: int, attempt: int, worker: int) -> str:
        return f"ws/{offer}/{stage}/{attempt}/ready/{worker}"

    @staticmethod
    def result(offer: int, stage: int, attempt: int, worker: int) -> str:
        """"1": the worker loaded every bucket of this attempt; "0": it did not."""
        return f"ws/{offer}/{stage}/{attempt}/result/{worker}"

    @staticmethod
    def plan(offer: int, stage: int, attempt: int) -> str:
        return f"ws/{offer}/{stage}/{attempt}/plan"

    @staticmethod
    def verdict(offer: int, stage: int, attempt: int) -> str:
        """"1": the leader retries with attempt + 1; "0": this attempt was the last."""
        return f"ws/{offer}/{stage}/{attempt}/verdict"

    @staticmethod
    def bucket(offer: int, stage: int, attempt: int, index: int) -> str:
        return f"ws/{offer}/{stage}/{attempt}/bucket/{index}"

    @staticmethod
    def done(offer: int, stage: int, attempt: int, index: int, worker: int) -> str:
        """A worker on the leader's GPU finished reading bucket ``index`` through its IPC handle."""
        return f"ws/{offer}/{stage}/{attempt}/done/{index}/{worker}"

    @staticmethod
    def ack(worker: int) -> str:
        """The weights version the worker's engine holds (a new process posts its own at start)."""
        return f"ws/ack/{worker}"


def offer_value(offer: int, version: int) -> str:
    """What ``SyncKeys.offer`` holds."""
    return json.dumps({"offer": offer, "version": version})


def parse_offer(raw: bytes | None) -> tuple[int, int] | None:
    """(offer, version) of a ``SyncKeys.offer`` value, or None when there is none."""
    if raw is None:
        return None
    value = json.loads(raw)
    return int(value["offer"]), int(value["version"])


@dataclass
class SyncReport:
    """What one ``publish`` did on one stage leader."""

    version: int  # version offered
    stage: int  # PP stage of this leader
    members: list[int]  # workers the stage reached
    missing: list[str] = field(default_factory=list)  # live workers left out (not ready/failed)
    acked: list[int] = field(default_factory=list)  # coordinator only: workers that acked
    published: bool = False  # coordinator only: the published version moved to ``version``
    attempts: int = 1  # rounds used (> 1: workers came at different times, or one failed and was served again)
    buckets: int = 0  # buckets sent
    bytes: int = 0  # payload bytes sent
    seconds: float = 0.0  # wall time of publish
    wait_seconds: float = 0.0  # of which waiting for the workers' safe points (their "ready")
    transfer_seconds: float = 0.0  # of which sending: each round's stream and its members' results
    rounds_sent: int = 0  # rounds that sent weights (a worker waits for its own round only)
    ipc: list[int] = field(default_factory=list)  # members reached by CUDA IPC (on the leader's GPU)


@dataclass
class StagedWeights:
    """One version of a stage's weights packed into bucket buffers ahead of its publish."""

    version: int  # the trainer version they are
    buckets: list[PackedBucket]  # every bucket, packed
    ready: torch.cuda.Event | None  # recorded after the packing copies (CUDA), else None
    nbytes: int  # payload bytes


class WeightSyncFailed(RuntimeError):
    """No rollout worker could take a version (each one's reason in the message): the run
    cannot go on, since workers would generate from weights the trainer left behind."""


class WeightLoadError(RuntimeError):
    """This worker's engine could not load the weights it received (wrong model, out of memory):
    nothing later can fix that, so the worker reports it and exits."""
