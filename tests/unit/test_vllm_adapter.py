"""The ``vllm`` adapter's own logic on CPU, against ``fake_vllm`` (a FAKE of vLLM's API; see there).

What is checked here is ours: groups stream back as they finish; ``interrupt`` aborts running
requests, keeps their tokens and continues them on the new weights with exact per-token
versions and log-probs; ``finish`` refuses to pause a running engine; the weight load goes
through ``collective_rpc`` by method name with msgpack-native arguments, between pause and
prefix-cache reset; feature detection of the release's API. The real engine is tested by
``tests/gpu/test_vllm_backend.py`` on the GPU machine.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest
import torch
import transformers

from megatron_darl.rollout.config import EngineConfig, SamplingConfig
from megatron_darl.rollout.engines import vllm_compat as compat
from tests.distributed.procs.sources import save_tiny_model, tiny_config
from tests.unit import fake_vllm

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(str(path))
    return str(path)


@pytest.fixture
def engine(monkeypatch, model_dir):
    fake_vllm.install(monkeypatch)
    from megatron_darl.rollout.engines.vllm import VLLMEngine

    eng = VLLMEngine(EngineConfig(backend="vllm", model_path=model_dir, dtype="fp32", timeout_s=60))
    yield eng
    eng.close()


def _teacher_forced(model, prefix, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prefix + ids])).logits[0, len(prefix) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def _wait(engine, keys, timeout_s=60.0):
    got, deadline = {}, time.monotonic() + timeout_s
    while set(keys) - set(got) and time.monotonic() < deadline:
        got.update((g.key, g.generations) for g in engine.poll(0.2))
    assert not set(keys) - set(got), f"groups {set(keys) - set(got)} did not finish"
    return got


def test_engine_args_carry_processed_logprobs_and_the_worker_extension(monkeypatch, model_dir):
    fake_vllm.install(monkeypatch)
    cfg = EngineConfig(backend="vllm", model_path=model_dir, dtype="bf16", compile=False, max_model_len=512,
                       vllm_args={"seed": 3})
    args = compat.engine_args(cfg)
    assert args.logprobs_mode == "processed_logprobs" and args.worker_extension_cls == compat.EXTENSION
    assert args.dtype == "bfloat16" and args.enforce_eager and args.max_model_len == 512 and args.seed == 3
    with pytest.raises(ValueError, match="vllm_args"):
        compat.engine_args(EngineConfig(backend="vllm", model_path=model_dir, vllm_args={"no_such_field": 1}))
    with pytest.raises(ValueError, match="weight_transfer"):
        EngineConfig(backend="vllm", weight_transfer="disk")


def test_the_engine_starts_with_the_offline_defaults_where_the_release_has_them(engine, monkeypatch):
    # rollouts are throughput work: LLM_CLASS scheduler defaults (16384 batched tokens on an H100, not 2048)
    assert fake_vllm.AsyncLLM.instances[-1].usage_context is fake_vllm.UsageContext.LLM_CLASS
    monkeypatch.delitem(sys.modules, "vllm.usage.usage_lib")  # a release without usage contexts
    assert compat.start_kwargs(fake_vllm.AsyncLLM) == {}


def test_flat_and_dict_logprobs_give_the_sampled_tokens_values():
    flat = SimpleNamespace(start_indices=[0, 1, 3], end_indices=[1, 3, 4], token_ids=[5, 9, 7, 2],
                           logprobs=[-0.5, -3.0, -1.5, -2.0])
    assert compat.sampled_logprobs([5, 7, 2], flat) == [-0.5, -1.5, -2.0]
    as_dicts = [{5: SimpleNamespace(logprob=-0.5)}, {7: SimpleNamespace(logprob=-1.5)}]
    assert compat.sampled_logprobs([5, 7], as_dicts) == [-0.5, -1.5]
    with pytest.raises(RuntimeError, match="no log-probs"):
        compat.sampled_logprobs([5], None)


def test_groups_stream_back_as_they_finish(engine):
    engine.submit("long", PROMPTS[0], SamplingConfig(n=1, max_new_tokens=200))
    for i in range(2):
        engine.submit(("short", i), PROMPTS[1], SamplingConfig(n=3, max_new_tokens=4))
    got = _wait(engine, [("short", 0), ("short", 1)])
    assert engine.inflight() == 1 and "long" not in got
    for gens in got.values():
        assert len(gens) == 3 and all(g.token_ids.numel() == 4 and g.finish_reason == "length" for g in gens)
    engine.pause(interrupt=True)  # stop the long one rather than wait for it
    engine.resume(0)


def test_interrupt_continues_on_new_weights_with_exact_versions_and_logprobs(engine, model_dir):
    fake = fake_vllm.AsyncLLM.instances[-1]
    old = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(21)
    new = transformers.AutoModelForCausalLM.from_config(tiny_config()).eval()
    sampling = SamplingConfig(n=2, max_new_tokens=30, temperature=1.0)
    engine.resume(4)
    for i, prompt in enumerate(PROMPTS):
        engine.submit(i, prompt, sampling)
    deadline = time.monotonic() + 30
    while fake.steps < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="finish"):
        engine.pause(interrupt=False)
    engine.pause(interrupt=True)
    fake.calls.clear()
    engine.load_weights(new.state_dict().items())
    engine.resume(5)
    assert fake.calls[0] == "rpc:darl_load_bytes" and fake.calls[-2:] == ["reset", "resume"]
    got = _wait(engine, [0, 1])
    for i, prompt in enumerate(PROMPTS):
        for g in got[i]:
            ids, versions = g.token_ids.tolist(), g.token_versions.tolist()
            k = versions.count(4)
            assert len(ids) == 30 and versions == [4] * k + [5] * (30 - k) and 0 < k < 30
            ref = torch.cat([_teacher_forced(old, prompt, ids[:k]), _teacher_forced(new, prompt + ids[:k], ids[k:])])
            torch.testing.assert_close(g.logprobs, ref, atol=1e-5, rtol=0)


def test_an_abort_reaches_requests_that_reach_the_engine_after_it(engine):
    fake = fake_vllm.AsyncLLM.instances[-1]
    fake.register_delay_s = 0.3  # the pause below comes after the requests start, before vLLM knows them
    engine.resume(2)
    engine.submit("g", PROMPTS[0], SamplingConfig(n=2, max_new_tokens=200))
    time.sleep(0.05)  # the adapter has started both requests (the first abort misses them)
    t0 = time.monotonic()
    engine.pause(interrupt=True)
    assert time.monotonic() - t0 < 5.0  # aborted again once registered, not left to run out
    fake.register_delay_s = 0.0
    engine.resume(3)
    gens = _wait(engine, ["g"])["g"]
    for g in gens:
        # tokens made between registration and the next abort (<= 50 ms) are version 2's, and say so
        versions = g.token_versions.tolist()
        k = versions.count(2)
        assert g.token_ids.numel() == 200 and versions == [2] * k + [3] * (200 - k) and k < 200


def test_weights_outside_a_pause_are_loaded_between_pause_and_reset(engine, model_dir):
    fake = fake_vllm.AsyncLLM.instances[-1]
    torch.manual_seed(3)
    new = transformers.AutoModelForCausalLM.from_config(tiny_config()).eval()
    greedy = SamplingConfig(n=1, max_new_tokens=6, temperature=0.0)
    before = engine.generate(PROMPTS, greedy)
    fake.calls.clear()
    engine.load_weights(new.state_dict().items())
    assert fake.calls == ["pause", "rpc:darl_load_bytes", "reset", "resume"]
    after = engine.generate(PROMPTS, greedy)
    for prompt, a, b in zip(PROMPTS, after, before):
        torch.testing.assert_close(a[0].logprobs, _teacher_forced(new, prompt, a[0].token_ids.tolist()),
                                   atol=1e-5, rtol=0)
        assert float((a[0].logprobs - b[0].logprobs).abs().max()) > 1e-3
    assert all(g[0].token_versions.tolist() == [engine.version] * 6 for g in after)


def test_a_failed_request_surfaces_in_poll(engine):
    engine.submit("bad", PROMPTS[0], SamplingConfig(n=1, max_new_tokens=5, stop_token_ids=[10**9]))
    fake = fake_vllm.AsyncLLM.instances[-1]

    async def broken(*args, **kwargs):
        raise ValueError("engine dead")
        yield  # pragma: no cover

    fake.generate = broken
    engine.submit("worse", PROMPTS[1], SamplingConfig(n=1, max_new_tokens=5))
    with pytest.raises(RuntimeError, match="vLLM generation failed"):
        _wait(engine, ["bad", "worse"])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit("too long", PROMPTS[0], SamplingConfig(n=1, max_new_tokens=10_000))
