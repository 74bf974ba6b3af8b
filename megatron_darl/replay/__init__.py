"""Replay buffer over the last K behavior versions and the per-version log-prob cache.

``ReplayBuffer`` keeps typed ``SampleGroup``s with their advantages and decides which may be
selected; ``LogProbCache`` keeps the per-token log-probs of those samples under each window
version. The loop evicts both together: ``cache.evict(buffer.evict(t))``. ``VersionWindow`` is
the one definition of which versions are kept.

Names are imported on first use (PEP 562): the run config reads ``window`` in every process,
the launcher's included, and that must not pull in torch with the buffer.
"""

from __future__ import annotations

from megatron_darl.lazy import lazy_exports

_HOMES = {
    "BufferEntry": "buffer", "ReplayBuffer": "buffer",
    "CacheRow": "logprob_cache", "LogProbCache": "logprob_cache", "RowSource": "logprob_cache",
    "VersionWindow": "window",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _HOMES, globals())
