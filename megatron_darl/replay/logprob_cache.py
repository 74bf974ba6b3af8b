"""Per-version log-prob cache: ``cache[sample, k] = log pi_k(y_ij)`` per token (docs/algorithm.md, section 7).

The multi-behavior weights need, for every selected sample, its log-probs under every behavior
version in the batch. Rows come from four places, each tagged so the loop can log how exact
the mixture was:

- ``engine``: the rollout engine's sampled-token log-probs, k = the sample's behavior version
  (the true behavior density: the k = v_i term of the mixture's conditional reads it);
- ``trainer``: the trainer's log-prob pass at step t over every buffered candidate;
- ``snapshot``: rows the trainer recomputed from kept parameter snapshots (exact backfill);
- ``nearest``: a copy of the nearest exact trainer-side row (``backfill_nearest``; an approximation).

A key ``(sample, k)`` has two slots: the engine's row and the trainer's (trainer, snapshot or
nearest). They are kept apart because the mixture's posterior over versions compares versions
and must read one source for every k, the trainer's, the sample's own version included, while
the conditional's own term reads the engine's (``get(..., trainer=False)``: the engine row where
there is one). The engine/trainer mismatch is a KL, positive on sampled tokens; mixing the two
sources in the posterior would add it up along the prefix and tip the posterior onto v_i.

Each DP shard keeps the rows of its own samples; rows leave with their sample (``evict``).
Rows are float32 tensors owned by the cache (copied on ``put``, on the device they were given;
the loop passes host tensors), so ``bytes()`` is exactly the memory held.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch


class RowSource(str, enum.Enum):
    """Where a cached row came from."""

    ENGINE = "engine"
    TRAINER = "trainer"
    SNAPSHOT = "snapshot"
    NEAREST = "nearest"


# In the trainer slot a put replaces an existing row only if its rank is <= the existing row's.
_RANK = {RowSource.TRAINER: 1, RowSource.SNAPSHOT: 1, RowSource.NEAREST: 2}


@dataclass(frozen=True)
class CacheRow:
    logprobs: torch.Tensor  # (T,) float32 per-token log pi_k of the sample's response
    source: RowSource


class LogProbCache:
    """Rows keyed by (sample_id, version), an engine and a trainer slot each (module docstring)."""

    def __init__(self) -> None:
        self._engine: dict[int, dict[int, CacheRow]] = {}  # sample_id -> version -> engine row
        self._trainer: dict[int, dict[int, CacheRow]] = {}  # sample_id -> version -> trainer-side row

    def __len__(self) -> int:
        return sum(1 for _ in self._all())

    def __contains__(self, key: tuple[int, int]) -> bool:
        """Whether the key has a row in either slot."""
        return self.has(*key)

    def has(self, sample_id: int, version: int, trainer: bool = False) -> bool:
        """Whether ``get(sample_id, version, trainer)`` finds a row."""
        return self._row(sample_id, version, trainer) is not None

    def _row(self, sample_id: int, version: int, trainer: bool) -> CacheRow | None:
        row = self._trainer.get(sample_id, {}).get(version)
        if trainer:
            return row
        return self._engine.get(sample_id, {}).get(version) or row

    def _all(self) -> Iterator[tuple[int, int, CacheRow]]:
        for slot in (self._engine, self._trainer):
            for sid, rows in slot.items():
                for v, r in rows.items():
                    yield sid, v, r

    def put(
        self, sample_id: int, version: int, logprobs: torch.Tensor, source: RowSource | str
    ) -> bool:
        """Store a ``(T,)`` row; returns False if a better-sourced row for the key is kept.

        An ``engine`` row goes to the engine slot; the others to the trainer slot, where
        ``trainer`` and ``snapshot`` rows replace each other and ``nearest`` rows, and a
        ``nearest`` row replaces only another one. All rows of a sample have the same length.
        """
        source = RowSource(source)
        if logprobs.dim() != 1:
            raise ValueError(
                f"logprobs of sample {sample_id} version {version} must be (T,), got "
                f"{tuple(logprobs.shape)}"
            )
        length = self._length(sample_id, default=-1)
        if length >= 0 and logprobs.shape[0] != length:
            raise ValueError(
                f"sample {sample_id}: row for version {version} has {logprobs.shape[0]} "
                f"tokens, cached rows have {length}"
            )
        slot = self._engine if source is RowSource.ENGINE else self._trainer
        rows = slot.setdefault(sample_id, {})
        old = rows.get(version)
        if old is not None and source is not RowSource.ENGINE and _RANK[source] > _RANK[old.source]:
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

    def get(self, sample_id: int, version: int, trainer: bool = False) -> torch.Tensor | None:
        """The ``(T,)`` row, or None if not cached: the engine's where there is one, else the
        trainer slot's; with ``trainer`` the trainer slot's only."""
        row = self._row(sample_id, version, trainer)
        return None if row is None else row.logprobs

    def source(self, sample_id: int, version: int, trainer: bool = False) -> RowSource | None:
        """The source of the row ``get`` returns."""
        row = self._row(sample_id, version, trainer)
        return None if row is None else row.source

    def versions(self, sample_id: int) -> list[int]:
        """Cached versions of a sample (either slot), ascending."""
        return sorted(set(self._engine.get(sample_id, {})) | set(self._trainer.get(sample_id, {})))

    def missing(self, sample_ids: Iterable[int], versions: Sequence[int],
                trainer: bool = False) -> list[tuple[int, int]]:
        """``(sample_id, version)`` pairs without a row (``trainer``: without a trainer-side row):
        what a snapshot backfill must compute."""
        return [(sid, v) for sid in sample_ids for v in versions if not self.has(sid, v, trainer)]

    def gather(
        self,
        sample_ids: Sequence[int],
        versions: Sequence[int],
        strict: bool = False,
        device: torch.device | str | None = None,
        trainer: bool = False,
    ) -> torch.Tensor:
        """``(K, n)`` float32 rows for ``versions`` x ``sample_ids`` in the packed layout.

        Row k holds each sample's cached row of ``versions[k]`` end to end (n = the samples'
        summed lengths), as ``get(..., trainer)`` picks it; a missing row is ``-inf`` throughout
        (a density that cannot be used by accident: it zeroes that version in a mixture, and
        ``batch_behavior_weights`` refuses it at real tokens), or with ``strict`` raises
        ``KeyError`` naming the missing rows. A sample with no row at all has length 0.
        """
        if strict:
            gaps = self.missing(sample_ids, versions, trainer)
            if gaps:
                raise KeyError(f"{len(gaps)} log-prob rows not cached, e.g. {gaps[:5]}")
        lengths = [self._length(sid) for sid in sample_ids]
        out = torch.full((len(versions), sum(lengths)), float("-inf"), dtype=torch.float32,
                         device=device)  # (K, n)
        start = 0
        for sid, n in zip(sample_ids, lengths):
            for k, version in enumerate(versions):
                row = self._row(sid, version, trainer)
                if row is not None:
                    out[k, start : start + n] = row.logprobs
            start += n
        return out

    def backfill_nearest(self, missing: Iterable[tuple[int, int]]) -> int:
        """Fill the trainer slot of the ``(sample_id, version)`` pairs ``missing`` with a copy of
        the sample's nearest exact trainer-side row (``trainer`` or ``snapshot``: never the
        engine's, whose mismatch would tip the mixture's posterior, nor a ``nearest`` copy).

        Nearest by ``|version - k|``, ties to the newer version. Samples with no exact trainer
        row are left missing. Returns the number of rows approximated.
        """
        filled = 0
        for sid, version in missing:
            rows = self._trainer.get(sid, {})
            if version in rows:
                continue
            exact = [v for v, r in rows.items() if r.source is not RowSource.NEAREST]
            if not exact:
                continue
            src = min(exact, key=lambda v: (abs(v - version), -v))
            rows[version] = CacheRow(rows[src].logprobs.clone(), RowSource.NEAREST)
            filled += 1
        return filled

    def evict(self, sample_ids: Iterable[int]) -> int:
        """Drop every row of these samples; returns the number of rows dropped."""
        dropped = 0
        for sid in sample_ids:
            dropped += len(self._engine.pop(sid, {})) + len(self._trainer.pop(sid, {}))
        return dropped

    def bytes(self) -> int:
        """Bytes of the row tensors held."""
        return sum(r.logprobs.numel() * r.logprobs.element_size() for _, _, r in self._all())

    def source_counts(self) -> dict[str, int]:
        """Rows per source, for the log (how much of the mixture is approximated)."""
        counts = {s.value: 0 for s in RowSource}
        for _, _, r in self._all():
            counts[r.source.value] += 1
        return counts

    def _length(self, sample_id: int, default: int = 0) -> int:
        rows = self._engine.get(sample_id) or self._trainer.get(sample_id)
        return next(iter(rows.values())).logprobs.shape[0] if rows else default

    def state_dict(self) -> dict[str, Any]:
        """Plain dict of lists, strings and tensors (``torch.load(weights_only=True)``)."""
        keys = list(self._all())
        return {
            "sample_ids": [sid for sid, _, _ in keys],
            "versions": [v for _, v, _ in keys],
            "sources": [r.source.value for _, _, r in keys],
            "rows": [r.logprobs.clone() for _, _, r in keys],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents with exactly what ``state_dict`` saved (each row to its slot)."""
        self._engine, self._trainer = {}, {}
        for sid, v, src, row in zip(
            state["sample_ids"], state["versions"], state["sources"], state["rows"], strict=True
        ):
            source = RowSource(src)
            slot = self._engine if source is RowSource.ENGINE else self._trainer
            slot.setdefault(int(sid), {})[int(v)] = CacheRow(row.clone(), source)
