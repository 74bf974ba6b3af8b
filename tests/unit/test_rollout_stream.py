"""``BatchStream``: the streaming contract over the ``hf`` engine, and per-token versions.

Whole-response mode must be the old batch call exactly (same tokens, same log-probs). Chunked
mode with a weight load between two polls (``interrupt``) must give responses whose tokens carry
the version that produced them, each token's log-prob being the one of the weights it was sampled
under (teacher-forced over prompt + earlier tokens).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_darl.rollout.config import EngineConfig, SamplingConfig
from megatron_darl.rollout.engines import build_engine
from megatron_darl.rollout.engines.stream import BatchStream, as_stream
from tests.distributed.procs.sources import save_tiny_model, tiny_config

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(str(path))
    return str(path)


def _engine(model_dir):
    return build_engine(EngineConfig(backend="hf", model_path=model_dir, device="cpu", max_batch_size=8))


def _other_weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config()).eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _teacher_forced(model, prefix: list[int], ids: list[int]) -> torch.Tensor:
    x = torch.tensor([prefix + ids])
    with torch.no_grad():
        logits = model(x).logits[0, len(prefix) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def test_whole_response_mode_is_the_batch_call(model_dir):
    sampling = SamplingConfig(n=2, max_new_tokens=6, temperature=1.0, seed=3)
    direct = _engine(model_dir).generate(PROMPTS, sampling)
    stream = BatchStream(_engine(model_dir))
    stream.resume(7)
    for key, prompt in enumerate(PROMPTS):
        stream.submit(key, prompt, sampling)
    assert stream.inflight() == 2
    got = {g.key: g.generations for g in stream.poll(0.0)}
    assert stream.inflight() == 0 and stream.poll(0.0) == []
    for key, gens in enumerate(direct):
        for a, b in zip(gens, got[key]):
            assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)
            assert b.token_versions.tolist() == [7] * b.token_ids.numel()


def test_interrupt_between_chunks_tags_tokens_with_the_weights_that_made_them(model_dir):
    engine = _engine(model_dir)
    old = {k: v.clone() for k, v in engine.state_dict().items()}
    stream = as_stream(engine, chunk_tokens=4)
    assert isinstance(stream, BatchStream)
    stream.resume(0)
    sampling = SamplingConfig(n=2, max_new_tokens=10, temperature=1.0, seed=1, ignore_eos=True)
    for key, prompt in enumerate(PROMPTS):
        stream.submit(key, prompt, sampling)
    assert stream.poll(0.0) == []  # 4 of 10 tokens per response so far
    with pytest.raises(RuntimeError, match="finish"):
        stream.pause(interrupt=False)  # mode 'finish' must drain first
    stream.pause(interrupt=True)
    new = _other_weights(seed=11)
    stream.load_weights(new.items())
    stream.resume(1)
    assert stream.poll(0.0) == []  # 8 of 10
    done = {g.key: g.generations for g in stream.poll(0.0)}
    assert sorted(done) == [0, 1] and stream.inflight() == 0

    model_old = transformers.AutoModelForCausalLM.from_config(tiny_config()).eval()
    model_old.load_state_dict(old)
    model_new = transformers.AutoModelForCausalLM.from_config(tiny_config()).eval()
    model_new.load_state_dict(new)
    for key, prompt in enumerate(PROMPTS):
        assert len(done[key]) == 2
        for gen in done[key]:
            ids = gen.token_ids.tolist()
            assert gen.finish_reason == "length" and len(ids) == 10
            assert gen.token_versions.tolist() == [0] * 4 + [1] * 6
            ref = torch.cat([_teacher_forced(model_old, prompt, ids[:4]),
                             _teacher_forced(model_new, prompt + ids[:4], ids[4:])])
            torch.testing.assert_close(gen.logprobs, ref, atol=2e-5, rtol=0)
            # the version split matters: the old weights do not explain the later tokens
            wrong = _teacher_forced(model_old, prompt, ids)[4:]
            assert float((wrong - gen.logprobs[4:]).abs().max()) > 1e-2


def test_chunks_stop_at_a_stop_token_and_at_the_length_limit(model_dir):
    engine = _engine(model_dir)
    greedy = SamplingConfig(n=1, max_new_tokens=7, temperature=0.0)
    whole = engine.generate([PROMPTS[0]], greedy)[0][0].token_ids.tolist()
    stream = BatchStream(engine, chunk_tokens=3)
    stream.submit("a", PROMPTS[0], greedy)
    out = []
    while not out:
        out = stream.poll(0.0)
    gen = out[0].generations[0]
    assert gen.token_ids.tolist() == whole and gen.finish_reason == "length"  # 3 + 3 + 1, cut at 7
    stop = whole[4]
    first = whole.index(stop)
    stream.submit("b", PROMPTS[0], SamplingConfig(n=1, max_new_tokens=7, temperature=0.0, stop_token_ids=[stop]))
    out = []
    while not out:
        out = stream.poll(0.0)
    gen = out[0].generations[0]
    assert gen.finish_reason == "stop" and gen.token_ids.tolist() == whole[: first + 1]
