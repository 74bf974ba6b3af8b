"""Replay buffer over the last K behavior versions and the per-version log-prob cache.

``ReplayBuffer`` keeps typed ``SampleGroup``s with their advantages and decides which may be
selected; ``LogProbCache`` keeps the per-token log-probs of those samples under each window
version. The loop evicts both together: ``cache.evict(buffer.evict(t))``. ``VersionWindow`` is
the one definition of which versions are kept.

Names are imported on first use (PEP 562): the run config reads ``window`` in every process,
the launcher's included, and that must not pull in torch with the buffer.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "BufferEntry": "buffer", "ReplayBuffer": "buffer",
    "CacheRow": "logprob_cache", "LogProbCache": "logprob_cache", "RowSource": "logprob_cache",
    "VersionWindow": "window",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
