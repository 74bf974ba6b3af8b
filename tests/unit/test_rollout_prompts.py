"""Sharded, resumable prompt source."""

from __future__ import annotations

import pytest

from megatron_darl.rollout.prompts import PromptRecord, PromptSource

RECORDS = [PromptRecord(prompt_id=i, token_ids=(i,)) for i in range(10)]


def test_shards_partition_each_epoch_and_reshuffle():
    sources = [PromptSource(RECORDS, s, 3, seed=5) for s in range(3)]
    per_shard = [len(s._order) for s in sources]
    first = sorted(s.next().prompt_id for s in sources for _ in range(len(s._order)))
    assert first == list(range(10)) and sorted(per_shard) == [3, 3, 4]
    epoch1 = [sources[0].next().prompt_id for _ in range(per_shard[0])]
    assert sources[0].state.epoch == 1 and len(set(epoch1)) == per_shard[0]


def test_resume_from_state_dict_continues_the_same_sequence():
    a = PromptSource(RECORDS, 1, 2, seed=3)
    for _ in range(7):
        a.next()
    state = a.state_dict()
    expected = [a.next().prompt_id for _ in range(9)]
    b = PromptSource(RECORDS, 1, 2, seed=3)
    b.load_state_dict(state)
    assert [b.next().prompt_id for _ in range(9)] == expected


def test_bad_shard_is_rejected():
    with pytest.raises(ValueError, match="shard"):
        PromptSource(RECORDS, 2, 2)
