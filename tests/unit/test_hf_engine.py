"""The ``hf`` backend: its sampled-token log-probs are the sampling distribution's, and weights
loaded in place change what it generates."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_darl.rollout.config import EngineConfig, SamplingConfig
from megatron_darl.rollout.engines import build_engine
from megatron_darl.rollout.engines.hf import HFEngine
from tests.distributed.procs.sources import save_tiny_model, tiny_config

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(str(path))
    return str(path)


def _teacher_forced(model, prompt, gen, temperature=1.0, top_k=-1):
    ids = torch.tensor([prompt + gen.token_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, gen.token_ids[:, None])[:, 0]


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 20), (0.0, -1)])
def test_sampled_logprobs_equal_teacher_forced_recomputation(model_dir, temperature, top_k):
    engine = build_engine(EngineConfig(backend="hf", model_path=model_dir, device="cpu", max_batch_size=4))
    sampling = SamplingConfig(n=3, max_new_tokens=10, temperature=temperature, top_k=top_k, seed=1)
    out = engine.generate(PROMPTS, sampling)
    assert [len(g) for g in out] == [3, 3, 3]
    for prompt, gens in zip(PROMPTS, out):
        for gen in gens:
            assert gen.token_ids.dtype == torch.int64 and gen.logprobs.dtype == torch.float32
            assert gen.token_ids.shape == gen.logprobs.shape and gen.token_ids.numel() >= 1
            ref = _teacher_forced(engine.model, prompt, gen, temperature if temperature > 0 else 1.0, top_k)
            torch.testing.assert_close(gen.logprobs, ref, atol=2e-5, rtol=0)
            assert torch.isfinite(gen.logprobs).all()


def test_another_sampling_configs_generations_leave_the_seed_stream_where_it_was(model_dir):
    """Held-out evaluation runs on the training engine between its batches (eval/periodic.py):
    its generations must not shift the seeds of the training stream, or evaluating changes what
    is trained."""
    engine = build_engine(EngineConfig(backend="hf", model_path=model_dir, device="cpu", max_batch_size=4))
    train = SamplingConfig(n=2, max_new_tokens=6, temperature=1.0, seed=3)
    alone = [engine.generate(PROMPTS, train) for _ in range(2)]
    engine = build_engine(EngineConfig(backend="hf", model_path=model_dir, device="cpu", max_batch_size=4))
    first = engine.generate(PROMPTS, train)
    engine.generate(PROMPTS[:1], SamplingConfig(n=1, max_new_tokens=6, temperature=1.0, seed=3))  # an evaluation
    second = engine.generate(PROMPTS, train)
    ids = lambda out: [g.token_ids.tolist() for gens in out for g in gens]  # noqa: E731
    assert ids(first) == ids(alone[0]) and ids(second) == ids(alone[1])
    assert ids(alone[0]) != ids(alone[1])  # the stream moves on from batch to batch


def test_stop_token_ends_a_response_with_finish_reason_stop(model_dir):
    engine = build_engine(EngineConfig(backend="hf", model_path=model_dir, device="cpu"))
    greedy = engine.generate([[1, 2, 3]], SamplingConfig(n=1, max_new_tokens=8, temperature=0.0))[0][0]
    assert greedy.finish_reason == "length" and greedy.token_ids.numel() == 8
    stop = int(greedy.token_ids[2])
    cut = engine.generate([[1, 2, 3]], SamplingConfig(n=1, max_new_tokens=8, temperature=0.0, stop_token_ids=[stop]))[0][0]
    first = greedy.token_ids.tolist().index(stop)
    assert cut.finish_reason == "stop" and cut.token_ids.tolist() == greedy.token_ids[: first + 1].tolist()


def test_in_place_weight_loading_changes_outputs_accordingly(model_dir):
    engine = build_engine(EngineConfig(backend="hf", model_path=model_dir, device="cpu"))
    greedy = SamplingConfig(n=1, max_new_tokens=12, temperature=0.0)
    before = engine.generate(PROMPTS, greedy)
    torch.manual_seed(77)
    other = transformers.AutoModelForCausalLM.from_config(tiny_config()).eval()
    params_before = {id(p) for p in engine.model.parameters()}
    engine.load_weights(other.state_dict().items())
    assert {id(p) for p in engine.model.parameters()} == params_before  # in place, same tensors
    after = engine.generate(PROMPTS, greedy)
    reference = HFEngine(EngineConfig(device="cpu"), model=other).generate(PROMPTS, greedy)
    assert [g[0].token_ids.tolist() for g in after] == [g[0].token_ids.tolist() for g in reference]
    # (random tiny models repeat tokens greedily, so compare the engine's log-probs, not only ids)
    assert max((a[0].logprobs - b[0].logprobs).abs().max().item() for a, b in zip(after, before)) > 1e-3
    for a, r in zip(after, reference):
        torch.testing.assert_close(a[0].logprobs, r[0].logprobs, atol=1e-5, rtol=0)


def test_bad_names_and_backends_are_rejected(model_dir):
    engine = build_engine(EngineConfig(backend="hf", model_path=model_dir, device="cpu"))
    with pytest.raises(ValueError, match="not_a_weight"):
        engine.load_weights([("not_a_weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="EngineConfig.backend"):
        build_engine(EngineConfig(backend="sglang"))
    with pytest.raises(ValueError, match="model_path"):
        build_engine(EngineConfig(backend="hf"))
