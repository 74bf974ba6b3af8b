"""What a resumed run hands from the trainer to fresh rollout workers through the store.

A restart brings a new control-plane store, so the trainer (rank 0) re-seeds it from its
checkpoint before any worker generates: the global ``groups_started`` counter (the groups it had
received: the staleness bound continues where it was; groups in flight at the kill are not
counted and never arrive), and per worker the number of its groups received, from which the
worker's prompt position follows (one prompt per group, ``PromptSource`` order). Workers wait
for ``READY_KEY``, which a fresh run sets too, so they never read a half-written state. Resumed
workers start with ``worker.initial_version = -1`` (``launch.train``): they generate only after
the trainer has published the resumed weights.

The same per-worker key serves a rollout worker restarted inside a live run (same store): the
worker moves it as it starts groups (``Keys.groups_made``), so its next process continues after
every group id its predecessor started, and none is delivered twice.
"""

from __future__ import annotations

from typing import Sequence

from megatron_darl.transport.store import Keys, get_int, wait_key

READY_KEY = "darl/loop/ready"  # set by trainer rank 0 once resume state (if any) is in place


def worker_key(worker_id: int) -> str:
    return Keys.groups_made(worker_id)


def seed_store(store, groups_received: int, worker_groups: Sequence[int]) -> None:
    """Trainer rank 0, on resume: restore the staleness counter and each worker's position."""
    store.add(Keys.STARTED, int(groups_received) - store.add(Keys.STARTED, 0))  # a counter: add only
    for w, made in enumerate(worker_groups):
        store.set(worker_key(w), str(int(made)))


def mark_ready(store) -> None:
    store.set(READY_KEY, "1")


def worker_groups_made(store, worker_id: int, timeout_s: float) -> int:
    """Worker side: wait for the trainer, then the number of this worker's groups received."""
    wait_key(store, READY_KEY, timeout_s, "the trainer's start (resume state)")
    return get_int(store, worker_key(worker_id), 0)


def prompt_position(groups_made: int, shard_size: int) -> dict[str, int]:
    """``PromptSource.state_dict`` after ``groups_made`` prompts of a shard of ``shard_size``."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return {"epoch": groups_made // shard_size, "index": groups_made % shard_size}
