"""The run's shared numbers as plain values: the staleness bound and the topology.

The user states each once (``algorithm.max_staleness``, ``algorithm.groups_per_step``,
``cluster.rollout_workers``, ``cluster.trainer_ranks``, ``parallel.tp`` / ``parallel.pp``);
``RunConfig.bound`` and ``RunConfig.topology`` derive these values from them in one place, and
the gate, the ledger, the worker, the hubs, the weight sender and receiver and the endpoints
take them as arguments. Nothing here imports anything, so every layer can.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessBound:
    """eta and B: a group may start while ``groups_started <= (t + eta + 1) * B`` (t published)."""

    max_staleness: int  # eta: versions a trained group's oldest token may lag the trainer
    groups_per_step: int  # B: prompt groups the trainer consumes per optimizer step

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"algorithm.max_staleness must be >= 0, got {self.max_staleness}")
        if self.groups_per_step < 1:
            raise ValueError(f"algorithm.groups_per_step must be >= 1, got {self.groups_per_step}")

    def capacity(self, version: int) -> int:
        """Largest ``groups_started`` allowed while version ``version`` is published."""
        return (version + self.max_staleness + 1) * self.groups_per_step

    @property
    def window(self) -> int:
        """Groups the bound lets start ahead of the published version: ``(eta + 1) * B``."""
        return self.capacity(0)


@dataclass(frozen=True)
class Topology:
    """Who takes part in the run: rollout workers, trainer DP hubs, trainer PP stages."""

    workers: int  # rollout worker processes (worker ids 0..workers-1)
    hubs: int = 1  # trainer DP hub ranks, one per DP replica (TP 0, first PP stage)
    stages: int = 1  # trainer PP stages, each with one weight-sync leader

    def __post_init__(self) -> None:
        for name in ("workers", "hubs", "stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"Topology.{name} must be >= 1, got {getattr(self, name)}")
