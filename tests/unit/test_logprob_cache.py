"""LogProbCache: sources and precedence, packed gather, backfill, eviction, bytes, state."""

import io

import pytest
import torch

from megatron_darl.replay import LogProbCache, RowSource


def row(values):
    return torch.tensor(values, dtype=torch.float32)


def test_put_get_versions_and_source_precedence():
    cache = LogProbCache()
    assert cache.put(1, 3, row([-1.0, -2.0]), "engine")
    assert not cache.put(1, 3, row([-9.0, -9.0]), RowSource.TRAINER)  # engine row is kept
    assert torch.equal(cache.get(1, 3), row([-1.0, -2.0]))
    assert cache.source(1, 3) is RowSource.ENGINE
    assert cache.put(1, 5, row([-0.5, -0.5]), "nearest")
    assert cache.put(1, 5, row([-0.7, -0.7]), "snapshot")  # exact replaces approximate
    assert cache.put(1, 5, row([-0.6, -0.6]), "trainer")  # trainer and snapshot are equals
    assert not cache.put(1, 5, row([0.0, 0.0]), "nearest")
    assert cache.source(1, 5) is RowSource.TRAINER and cache.versions(1) == [3, 5]
    assert cache.get(1, 4) is None and cache.get(2, 3) is None
    assert (1, 5) in cache and (1, 4) not in cache and len(cache) == 2
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
    with pytest.raises(KeyError, match=r"\(10, 2\)"):
        cache.gather([10, 11], [1, 2], strict=True)


def test_backfill_nearest_counts_and_picks_nearest_exact_row():
    cache = LogProbCache()
    cache.put(1, 4, row([-4.0]), "engine")
    cache.put(1, 6, row([-6.0]), "trainer")
    cache.put(2, 7, row([-7.0]), "engine")
    filled = cache.backfill_nearest([1, 2, 3], [3, 4, 5, 6, 7])
    # sample 1 gets 3, 5, 7; sample 2 gets 3..6; sample 3 has nothing to copy from
    assert filled == 3 + 4
    assert cache.get(1, 3).item() == -4.0 and cache.get(1, 7).item() == -6.0
    assert cache.get(1, 5).item() == -6.0  # tie between 4 and 6 goes to the newer
    assert cache.source(1, 5) is RowSource.NEAREST and cache.source(1, 4) is RowSource.ENGINE
    assert cache.versions(3) == []
    assert cache.source_counts() == {"engine": 2, "trainer": 1, "snapshot": 0, "nearest": 7}
    cache.put(2, 5, row([-5.0]), "snapshot")  # an exact row replaces the approximation
    assert cache.source(2, 5) is RowSource.SNAPSHOT and cache.backfill_nearest([2], [5]) == 0


def test_backfill_never_copies_an_approximation():
    cache = LogProbCache()
    cache.put(1, 0, row([-1.0]), "nearest")
    assert cache.backfill_nearest([1], [1, 2]) == 0


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
    cache.backfill_nearest([1], [1])
    blob = io.BytesIO()
    torch.save(cache.state_dict(), blob)
    blob.seek(0)
    restored = LogProbCache()
    restored.put(9, 9, torch.randn(2), "engine")  # replaced by the load
    restored.load_state_dict(torch.load(blob, weights_only=True))
    assert restored.bytes() == cache.bytes() and len(restored) == len(cache) == 4
    for sid in (1, 2):
        assert restored.versions(sid) == cache.versions(sid)
        for v in cache.versions(sid):
            assert torch.equal(restored.get(sid, v), cache.get(sid, v))
            assert restored.source(sid, v) is cache.source(sid, v)
    assert restored.versions(9) == []


def test_put_packed_cuts_rows_by_length_and_respects_precedence():
    cache = LogProbCache()
    cache.put(2, 4, row([-1.0]), "engine")
    packed = torch.tensor([-0.1, -0.2, -0.3, -0.4])
    assert cache.put_packed([1, 2], 4, packed, [3, 1], "trainer") == 1  # sample 2 keeps engine
    assert torch.equal(cache.get(1, 4), row([-0.1, -0.2, -0.3]))
    assert torch.equal(cache.get(2, 4), row([-1.0]))
    assert cache.bytes() == 4 * 4
    with pytest.raises(ValueError, match="packed"):
        cache.put_packed([1, 2], 5, packed, [4, 1], "trainer")
