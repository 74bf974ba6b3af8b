"""Replay buffer over the last K behavior versions and the per-version log-prob cache.

``ReplayBuffer`` keeps typed ``SampleGroup``s with their advantages and decides which may be
selected; ``LogProbCache`` keeps the per-token log-probs of those samples under each window
version. The loop evicts both together: ``cache.evict(buffer.evict(t))``. ``VersionWindow`` is
the one definition of which versions are kept.
"""

from megatron_darl.replay.buffer import BufferEntry, ReplayBuffer
from megatron_darl.replay.logprob_cache import CacheRow, LogProbCache, RowSource
from megatron_darl.replay.window import VersionWindow

__all__ = ["BufferEntry", "CacheRow", "LogProbCache", "ReplayBuffer", "RowSource", "VersionWindow"]
