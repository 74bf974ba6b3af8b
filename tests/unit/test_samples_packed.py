"""PackedSamples: a group packed once on arrival equals the per-sample packing the step did before.

The reference (``per_sample``) is the old ``sequence_batch``: each sample re-packed as
``prompt ++ response`` with a zero/one loss mask, then ``TrainBatch.from_sequences``; the engine
rows were ``torch.cat`` of each sample's row. It is built from clones taken before packing, so a
packing that misplaced a sample could not agree with it through the shared views.
"""

import io

import pytest
import torch

from megatron_darl.replay import ReplayBuffer, VersionWindow
from megatron_darl.samples import PackedSamples, Sample, SampleGroup, pack_samples, share_packed
from megatron_darl.step.sequences import packed_batch
from megatron_darl.trainer.batch import TrainBatch


def make_samples(lengths=(3, 1, 5, 2), prompts=(4, 2, 1, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(sample_id=seed * 100 + i, prompt_ids=torch.randint(0, 50, (p,), generator=g),
                   response_ids=torch.randint(0, 50, (n,), generator=g),
                   behavior_logprobs=-torch.rand(n, generator=g), token_versions=torch.full((n,), 2),
                   reward=float(i % 2))
            for i, (n, p) in enumerate(zip(lengths, prompts))]


def originals(samples):
    return [(s.prompt_ids.clone(), s.response_ids.clone(), s.behavior_logprobs.clone()) for s in samples]


def per_sample(rows) -> tuple[TrainBatch, torch.Tensor]:
    """The batch and engine rows as the step built them from each sample, before packing on arrival."""
    tokens = [torch.cat([p.long(), r.long()]) for p, r, _ in rows]
    masks = [torch.cat([torch.zeros(p.shape[0], dtype=torch.bool), torch.ones(r.shape[0], dtype=torch.bool)])
             for p, r, _ in rows]
    return TrainBatch.from_sequences(tokens, masks), torch.cat([b.to(torch.float32) for _, _, b in rows])


def assert_packed_equals(packed: PackedSamples, rows, behavior=True):
    want, engine = per_sample(rows)
    got = packed_batch(packed)
    for name in ("input_ids", "seq_lens", "loss_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(packed.lengths, torch.tensor([r.shape[0] for _, r, _ in rows]))
    if behavior:
        assert packed.behavior_logprobs.dtype == torch.float32
        assert torch.equal(packed.behavior_logprobs, engine)


def test_a_packed_group_is_the_per_sample_batch_and_its_pieces_are_views():
    samples = make_samples()
    rows = originals(samples)
    packed = pack_samples(samples)
    assert_packed_equals(packed, rows)
    for first, end in [(0, 4), (1, 3), (2, 3), (3, 4)]:
        piece = packed.slice(first, end)
        assert_packed_equals(piece, rows[first:end])
        for name in ("input_ids", "loss_mask", "behavior_logprobs"):  # views: no copy
            assert getattr(piece, name).untyped_storage().data_ptr() == \
                getattr(packed, name).untyped_storage().data_ptr()


def test_concatenated_groups_are_the_per_sample_batch_of_all_their_samples():
    a, b = make_samples(seed=1), make_samples((2, 6), (1, 5), seed=2)
    rows = originals(a) + originals(b)
    pa, pb = pack_samples(a), pack_samples(b)
    assert_packed_equals(PackedSamples.concat([pa, pb]), rows)
    tokens_only = PackedSamples.concat([pa, pb.slice(1, 2)], rows=False)
    assert tokens_only.behavior_logprobs is None
    assert_packed_equals(tokens_only, rows[:4] + rows[5:], behavior=False)
    assert PackedSamples.concat([pa]) is pa  # one part: nothing copied
    with pytest.raises(ValueError, match="zero"):
        PackedSamples.concat([])


def test_shared_samples_read_the_packed_storage_with_their_own_values():
    samples = make_samples(seed=3)
    samples[1].behavior_logprobs = samples[1].behavior_logprobs.double()  # not the documented dtype
    rows = originals(samples)
    packed = pack_samples(samples)
    share_packed(samples, packed)
    for s, (p, r, b) in zip(samples, rows):
        assert torch.equal(s.prompt_ids, p) and torch.equal(s.response_ids, r)
        assert s.behavior_logprobs.dtype == b.dtype and torch.equal(s.behavior_logprobs, b)
        assert s.prompt_ids.untyped_storage().data_ptr() == packed.input_ids.untyped_storage().data_ptr()
    assert samples[0].behavior_logprobs.untyped_storage().data_ptr() == \
        packed.behavior_logprobs.untyped_storage().data_ptr()
    assert samples[1].behavior_logprobs.untyped_storage().data_ptr() != \
        packed.behavior_logprobs.untyped_storage().data_ptr()  # float64 keeps its own tensor


def test_the_buffer_packs_on_arrival_and_again_on_restore():
    buf = ReplayBuffer(VersionWindow(3))
    groups = [SampleGroup(group_id=g, prompt_id=g, samples=make_samples(seed=10 + g), worker_id=0)
              for g in range(3)]
    rows = {g.group_id: originals(g.samples) for g in groups}
    for g in groups:
        entry = buf.add(g, step=0)
        assert_packed_equals(entry.packed, rows[g.group_id])
        assert all(s.response_ids.untyped_storage().data_ptr() == entry.packed.input_ids.untyped_storage().data_ptr()
                   for s in g.samples)  # the group is held once
    blob = io.BytesIO()
    torch.save(buf.state_dict(), blob)
    blob.seek(0)
    restored = ReplayBuffer(VersionWindow(1))
    restored.load_state_dict(torch.load(blob, weights_only=True))
    for e in restored.entries():
        assert_packed_equals(e.packed, rows[e.group_id])


def test_an_empty_prompt_is_refused_on_arrival_by_sample_id():
    buf = ReplayBuffer(VersionWindow(3))
    samples = make_samples(prompts=(4, 0, 1, 3), seed=4)
    with pytest.raises(ValueError, match=f"sample {samples[1].sample_id} has an empty prompt"):
        buf.add(SampleGroup(group_id=7, prompt_id=7, samples=samples, worker_id=0), step=0)
    assert len(buf) == 0 and 7 not in buf
