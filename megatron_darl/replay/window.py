"""The replay window (docs/architecture.md, Versions and staleness) as one object: ``VersionWindow(k)``.

At trainer version t the buffer holds groups whose behavior version lies in
``[max(0, t - K + 1), t]``; the log-prob cache holds rows for those versions; the trainer keeps
parameter snapshots of them for exact backfill. All of them ask this class, so they agree on
one formula (clamped at 0).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VersionWindow:
    """The last ``k`` behavior versions at a trainer version (``replay.k``)."""

    k: int  # window size K >= 1

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"replay.k must be >= 1, got {self.k}")

    def oldest(self, version: int) -> int:
        """Oldest version kept at trainer version ``version``: ``max(0, t - K + 1)``."""
        return max(0, version - self.k + 1)

    def versions(self, version: int) -> list[int]:
        """Versions kept at ``version``, ascending (at most K; fewer in the first K - 1 steps)."""
        return list(range(self.oldest(version), version + 1))

    def holds(self, behavior_version: int, version: int) -> bool:
        """Whether a sample of ``behavior_version`` is still inside the window at ``version``."""
        return self.oldest(version) <= behavior_version <= version
