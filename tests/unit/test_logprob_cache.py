"""LogProbCache: the engine and trainer slots, precedence, packed gather, backfill, eviction, bytes, state."""

import io

import pytest
import torch

from megatron_darl.replay import LogProbCache, RowSource


def row(values):
    return torch.tensor(values, dtype=torch.float32)


def test_put_get_versions_and_source_precedence():
    cache = LogProbCache()
    assert cache.put(1, 3, row([-1.0, -2.0]), "engine")
    assert cache.put(1, 3, row([-9.0, -9.0]), RowSource.TRAINER)  # the trainer slot, beside it
    assert torch.equal(cache.get(1, 3), row([-1.0, -2.0]))  # the engine row comes first
    assert torch.equal(cache.get(1, 3, trainer=True), row([-9.0, -9.0]))
    assert cache.source(1, 3) is RowSource.ENGINE and cache.source(1, 3, trainer=True) is RowSource.TRAINER
    assert cache.put(2, 7, row([-1.0]), "engine") and not cache.has(2, 7, trainer=True)
    assert cache.put(1, 5, row([-0.5, -0.5]), "nearest")
    assert cache.put(1, 5, row([-0.7, -0.7]), "snapshot")  # exact replaces approximate
    assert cache.put(1, 5, row([-0.6, -0.6]), "trainer")  # trainer and snapshot are equals
    assert not cache.put(1, 5, row([0.0, 0.0]), "nearest")
    assert cache.source(1, 5) is RowSource.TRAINER and cache.versions(1) == [3, 5]
    assert cache.get(1, 4) is None and cache.get(2, 3) is None
    assert (1, 5) in cache and (1, 4) not in cache and len(cache) == 4  # 1: 3 twice, 5; 2: 7
    with pytest.raises(ValueError, match="tokens"):
        cache.put(1, 6, row([-1.0]), "trainer")
    with pytest.raises(ValueError, match=r"\(T,\)"):
        cache.put(2, 6, torch.zeros(2, 2), "trainer")
    with pytest.raises(ValueError):
        cache.put(2, 6, row([0.0]), "guess")


def test_gather_packs_rows_and_marks_missing_rows():
    cache = LogProbCache()
    cache.put(10, 1, row([-1.0, -2.0, -3.0]), "engine")
    cache.put(11, 1, row([-4.0]), "trainer")
    cache.put(11, 2, row([-5.0]), "engine")
    out = cache.gather([10, 11], [1, 2])
    assert out.shape == (2, 4) and out.dtype == torch.float32  # (K, n): 3 + 1 tokens
    assert torch.equal(out[0], row([-1.0, -2.0, -3.0, -4.0]))
    assert out[1, 3].item() == -5.0
    assert torch.isneginf(out[1, :3]).all()  # sample 10 has no version-2 row
    assert cache.gather([11, 10], [1]).tolist() == [[-4.0, -1.0, -2.0, -3.0]]  # in the given order
    assert cache.missing([10, 11], [1, 2]) == [(10, 2)]
    assert cache.missing([10, 11], [1, 2], trainer=True) == [(10, 1), (10, 2), (11, 2)]
    cache.put(11, 2, row([-6.0]), "snapshot")
    assert cache.gather([11], [2]).item() == -5.0 and cache.gather([11], [2], trainer=True).item() == -6.0
    with pytest.raises(KeyError, match=r"\(10, 2\)"):
        cache.gather([10, 11], [1, 2], strict=True)


def test_backfill_nearest_copies_the_nearest_exact_trainer_row_never_the_engine_row():
    cache = LogProbCache()
    cache.put(1, 4, row([-4.0]), "engine")
    cache.put(1, 2, row([-2.0]), "snapshot")
    cache.put(1, 6, row([-6.0]), "trainer")
    cache.put(2, 7, row([-7.0]), "engine")
    want = [(1, v) for v in (3, 4, 5, 7)] + [(2, 6), (3, 5)]
    # sample 1 gets 3, 4 (its own version: the trainer slot), 5, 7; sample 2 has only its engine
    # row and sample 3 nothing: left missing
    assert cache.backfill_nearest(want) == 4
    assert cache.get(1, 3).item() == -2.0 and cache.get(1, 7).item() == -6.0  # tie 2/4: 4 is no trainer row
    assert cache.get(1, 5).item() == -6.0  # tie between 4 and 6: 4 holds only the engine row
    assert cache.get(1, 4, trainer=True).item() == -6.0 and cache.get(1, 4).item() == -4.0
    assert cache.source(1, 5) is RowSource.NEAREST and cache.source(1, 4) is RowSource.ENGINE
    assert cache.versions(3) == [] and not cache.has(2, 6)
    assert cache.source_counts() == {"engine": 2, "trainer": 1, "snapshot": 1, "nearest": 4}
    cache.put(1, 5, row([-5.0]), "snapshot")  # an exact row replaces the approximation
    assert cache.source(1, 5) is RowSource.SNAPSHOT and cache.backfill_nearest([(1, 5)]) == 0


def test_backfill_never_copies_an_approximation():
    cache = LogProbCache()
    cache.put(1, 0, row([-1.0]), "nearest")
    assert cache.backfill_nearest([(1, 1), (1, 2)]) == 0


def test_bytes_equal_tensors_held_and_evict():
    cache = LogProbCache()
    big = torch.randn(64, 100)
    cache.put(1, 0, big[3, :10], "engine")  # a view: the cache must copy, not pin `big`
    cache.put(1, 1, big[4, :10].double(), "trainer")  # stored as float32
    cache.put(2, 0, torch.randn(7), "engine")
    held = [cache.get(1, 0), cache.get(1, 1), cache.get(2, 0)]
    assert cache.bytes() == (10 + 10 + 7) * 4
    assert cache.bytes() == sum(t.untyped_storage().nbytes() for t in held)
    assert all(t.dtype == torch.float32 for t in held)
    assert cache.evict([1, 99]) == 2
    assert cache.bytes() == 7 * 4 and len(cache) == 1
    assert cache.evict([2]) == 1 and cache.bytes() == 0


def test_state_round_trip_is_exact():
    cache = LogProbCache()
    cache.put(1, 0, torch.randn(5), "engine")
    cache.put(1, 2, torch.randn(5), "snapshot")
    cache.put(2, 1, torch.randn(3), "trainer")
    cache.put(1, 0, torch.randn(5), "trainer")  # the trainer slot of the engine's key
    cache.backfill_nearest([(1, 1)])
    blob = io.BytesIO()
    torch.save(cache.state_dict(), blob)
    blob.seek(0)
    restored = LogProbCache()
    restored.put(9, 9, torch.randn(2), "engine")  # replaced by the load
    restored.load_state_dict(torch.load(blob, weights_only=True))
    assert restored.bytes() == cache.bytes() and len(restored) == len(cache) == 5
    for sid in (1, 2):
        assert restored.versions(sid) == cache.versions(sid)
        for v in cache.versions(sid):
            for trainer in (False, True):
                assert restored.has(sid, v, trainer) == cache.has(sid, v, trainer)
                if cache.has(sid, v, trainer):
                    assert torch.equal(restored.get(sid, v, trainer), cache.get(sid, v, trainer))
                    assert restored.source(sid, v, trainer) is cache.source(sid, v, trainer)
    assert restored.versions(9) == []


def test_put_packed_cuts_rows_by_length_and_respects_precedence():
    cache = LogProbCache()
    cache.put(2, 4, row([-1.0]), "engine")
    packed = torch.tensor([-0.1, -0.2, -0.3, -0.4])
    cache.put(2, 4, row([-0.9]), "trainer")
    assert cache.put_packed([1, 2], 4, packed, [3, 1], "nearest") == 1  # sample 2 keeps its trainer row
    assert torch.equal(cache.get(1, 4), row([-0.1, -0.2, -0.3]))
    assert torch.equal(cache.get(2, 4), row([-1.0])) and torch.equal(cache.get(2, 4, trainer=True), row([-0.9]))
    assert cache.bytes() == 5 * 4
    with pytest.raises(ValueError, match="packed"):
        cache.put_packed([1, 2], 5, packed, [4, 1], "trainer")
