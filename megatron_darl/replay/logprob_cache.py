"""Per-version log-prob cache: ``cache[sample, k] = log pi_k(y_ij)`` per token (docs/algorithm.md, section 7).

The multi-behavior weights need, for every selected sample, its log-probs under every behavior
version in the batch. Rows come from three places, each tagged so the loop can log how exact
the mixture was:

- ``engine``: the rollout engine's sampled-token log-probs, k = the sample's behavior version
  (the true behavior density; never replaced by a trainer row for the same version);
- ``trainer``: the trainer's log-prob pass at step t over every buffered candidate;
- ``snapshot``: rows the trainer recomputed from kept parameter snapshots (exact backfill);
- ``nearest``: a copy of the nearest exact version (``backfill_nearest``; an approximation).

Each DP shard keeps the rows of its own samples; rows leave with their sample (``evict``).
Rows are float32 tensors owned by the cache (copied on ``put``, on the device they were given;
the loop passes host tensors), so ``bytes()`` is exactly the memory held.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch


class RowSource(str, enum.Enum):
    """Where a cached row came from."""

    ENGINE = "engine"
    TRAINER = "trainer"
    SNAPSHOT = "snapshot"
    NEAREST = "nearest"


# A put replaces an existing row only if its rank is <= the existing row's rank.
_RANK = {RowSource.ENGINE: 0, RowSource.TRAINER: 1, RowSource.SNAPSHOT: 1, RowSource.NEAREST: 2}


@dataclass(frozen=True)
class CacheRow:
    logprobs: torch.Tensor  # (T,) float32 per-token log pi_k of the sample's response
    source: RowSource


class LogProbCache:
    """Rows keyed by (sample_id, version); see the module docstring for the sources."""

    def __init__(self) -> None:
        self._rows: dict[int, dict[int, CacheRow]] = {}  # sample_id -> version -> row

    def __len__(self) -> int:
        return sum(len(v) for v in self._rows.values())

    def __contains__(self, key: tuple[int, int]) -> bool:
        sample_id, version = key
        return version in self._rows.get(sample_id, {})

    def put(
        self, sample_id: int, version: int, logprobs: torch.Tensor, source: RowSource | str
    ) -> bool:
        """Store a ``(T,)`` row; returns False if a better-sourced row for the key is kept.

        An ``engine`` row is never replaced by another source; ``trainer`` and ``snapshot`` rows
        replace each other and ``nearest`` rows. All rows of a sample must have the same length.
        """
        source = RowSource(source)
        if logprobs.dim() != 1:
            raise ValueError(
                f"logprobs of sample {sample_id} version {version} must be (T,), got "
                f"{tuple(logprobs.shape)}"
            )
        rows = self._rows.setdefault(sample_id, {})
        if rows:
            length = next(iter(rows.values())).logprobs.shape[0]
            if logprobs.shape[0] != length:
                raise ValueError(
                    f"sample {sample_id}: row for version {version} has {logprobs.shape[0]} "
                    f"tokens, cached rows have {length}"
                )
        old = rows.get(version)
        if old is not None and _RANK[source] > _RANK[old.source]:
            return False
        row = logprobs.detach().to(torch.float32, copy=True).contiguous()
        rows[version] = CacheRow(row, source)
        return True

    def put_packed(
        self,
        sample_ids: Sequence[int],
        version: int,
        logprobs: torch.Tensor,
        lengths: torch.Tensor | Sequence[int],
        source: RowSource | str,
    ) -> int:
        """Store the rows of a packed ``(n,)`` tensor (e.g. the trainer's pass), cut by ``lengths``.

        The packed layout is the samples' response tokens end to end, the layout of the log-prob
        pass. Returns the number of rows stored (rows kept by precedence are not counted).
        """
        lengths = [int(n) for n in lengths]
        if logprobs.dim() != 1 or len(lengths) != len(sample_ids) or sum(lengths) != logprobs.shape[0]:
            raise ValueError(f"logprobs must be packed ({sum(lengths)},) for {len(sample_ids)} samples "
                             f"of lengths {lengths[:8]}..., got {tuple(logprobs.shape)}")
        rows = torch.split(logprobs, lengths)
        return sum(self.put(sid, version, r, source) for sid, r in zip(sample_ids, rows))

    def get(self, sample_id: int, version: int) -> torch.Tensor | None:
        """The ``(T,)`` row, or None if not cached."""
        row = self._rows.get(sample_id, {}).get(version)
        return None if row is None else row.logprobs

    def source(self, sample_id: int, version: int) -> RowSource | None:
        row = self._rows.get(sample_id, {}).get(version)
        return None if row is None else row.source

    def versions(self, sample_id: int) -> list[int]:
        """Cached versions of a sample, ascending."""
        return sorted(self._rows.get(sample_id, {}))

    def missing(self, sample_ids: Iterable[int], versions: Sequence[int]) -> list[tuple[int, int]]:
        """``(sample_id, version)`` pairs without a row: what a snapshot backfill must compute."""
        return [
            (sid, v) for sid in sample_ids for v in versions if v not in self._rows.get(sid, {})
        ]

    def gather(
        self,
        sample_ids: Sequence[int],
        versions: Sequence[int],
        strict: bool = False,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """``(K, n)`` float32 rows for ``versions`` x ``sample_ids`` in the packed layout.

        Row k holds each sample's cached row of ``versions[k]`` end to end (n = the samples'
        summed lengths); a missing row is ``-inf`` throughout (a density that cannot be used by
        accident: it zeroes that version in a mixture, and ``batch_behavior_weights`` refuses it
        at real tokens), or with ``strict`` raises ``KeyError`` naming the missing rows. A sample
        with no row at all has length 0.
        """
        if strict:
            gaps = self.missing(sample_ids, versions)
            if gaps:
                raise KeyError(f"{len(gaps)} log-prob rows not cached, e.g. {gaps[:5]}")
        lengths = [self._length(sid) for sid in sample_ids]
        out = torch.full((len(versions), sum(lengths)), float("-inf"), dtype=torch.float32,
                         device=device)  # (K, n)
        start = 0
        for sid, n in zip(sample_ids, lengths):
            rows = self._rows.get(sid, {})
            for k, version in enumerate(versions):
                row = rows.get(version)
                if row is not None:
                    out[k, start : start + n] = row.logprobs
            start += n
        return out

    def backfill_nearest(self, sample_ids: Iterable[int], versions: Sequence[int]) -> int:
        """Fill missing rows with a copy of the nearest exact row (not itself a ``nearest`` copy).

        Nearest by ``|version - k|``, ties to the newer version. Samples with no exact row are
        left missing. Returns the number of rows approximated.
        """
        filled = 0
        for sid in sample_ids:
            rows = self._rows.get(sid, {})
            exact = [v for v, r in rows.items() if r.source is not RowSource.NEAREST]
            if not exact:
                continue
            for version in versions:
                if version in rows:
                    continue
                src = min(exact, key=lambda v: (abs(v - version), -v))
                rows[version] = CacheRow(rows[src].logprobs.clone(), RowSource.NEAREST)
                filled += 1
        return filled

    def evict(self, sample_ids: Iterable[int]) -> int:
        """Drop every row of these samples; returns the number of rows dropped."""
        dropped = 0
        for sid in sample_ids:
            dropped += len(self._rows.pop(sid, {}))
        return dropped

    def bytes(self) -> int:
        """Bytes of the row tensors held."""
        return sum(
            r.logprobs.numel() * r.logprobs.element_size()
            for rows in self._rows.values() for r in rows.values()
        )

    def source_counts(self) -> dict[str, int]:
        """Rows per source, for the log (how much of the mixture is approximated)."""
        counts = {s.value: 0 for s in RowSource}
        for rows in self._rows.values():
            for r in rows.values():
                counts[r.source.value] += 1
        return counts

    def _length(self, sample_id: int) -> int:
        rows = self._rows.get(sample_id)
        return next(iter(rows.values())).logprobs.shape[0] if rows else 0

    def state_dict(self) -> dict[str, Any]:
        """Plain dict of lists, strings and tensors (``torch.load(weights_only=True)``)."""
        keys = [(sid, v) for sid, rows in self._rows.items() for v in rows]
        return {
            "sample_ids": [sid for sid, _ in keys],
            "versions": [v for _, v in keys],
            "sources": [self._rows[sid][v].source.value for sid, v in keys],
            "rows": [self._rows[sid][v].logprobs.clone() for sid, v in keys],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents with exactly what ``state_dict`` saved."""
        self._rows = {}
        for sid, v, src, row in zip(
            state["sample_ids"], state["versions"], state["sources"], state["rows"], strict=True
        ):
            self._rows.setdefault(int(sid), {})[int(v)] = CacheRow(row.clone(), RowSource(src))
