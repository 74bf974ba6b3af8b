"""Held-out evaluation while training (``eval.*``): the keys' checks, the schedule, the held-out
split of the built-in task, the points' metrics, the trainer-side requests over a store, and the
logger's records (kept across a resume, never counted as training steps)."""

from __future__ import annotations

import json
import time

import pytest

from launch.config import load_run_config
from launch.preflight import check_eval
from megatron_darl.data.config import DataConfig
from megatron_darl.data.loaders import load_dataset
from megatron_darl.eval.config import PeriodicEvalConfig
from megatron_darl.eval.periodic import heldout_sets, is_due, planned, point_metrics
from megatron_darl.loop.heldout_eval import HeldoutRequests, HeldoutServer, request_key, result_key


@pytest.mark.parametrize("override, message", [
    ("eval.benchmarks=[heldot]", "eval.benchmarks: 'heldot' is not a benchmark; known: heldout, gsm8k"),
    ("eval.every_n_steps=-1", "eval.every_n_steps=-1 must be >= 0"),
    ("eval.worker=1", "eval.worker=1 must be below cluster.rollout_workers=1"),
    ("eval.n=4", "eval.n=4 with eval.temperature=0"),
    ("eval.ks=[2]", "eval.ks=[2]: every k must be in [1, eval.n=1]"),
    ("eval.limit=0", "eval.limit=0.0: use a prompt count"),
    ("eval.benchmarks=[heldout,heldout]", "a benchmark is named twice"),
])
def test_a_bad_eval_key_is_refused_naming_it(override, message):
    with pytest.raises(ValueError) as err:
        check_eval(load_run_config([override]))
    assert message in str(err.value)


def test_the_launcher_exits_2_naming_an_unknown_benchmark(capsys):
    from launch.train import main

    assert main(["eval.benchmarks=[gsm8kk]", "loop.run_dir=/nonexistent/never"]) == 2
    assert "eval.benchmarks: 'gsm8kk' is not a benchmark" in capsys.readouterr().err


def test_default_config_scores_the_start_and_the_end():
    cfg = load_run_config([]).eval
    assert cfg.benchmarks == ["heldout"] and cfg.n == 1 and cfg.temperature == 0
    assert [v for v in range(41) if is_due(cfg, v, final=v == 40)] == [0, 40]
    every = PeriodicEvalConfig(benchmarks=["heldout"], every_n_steps=10, at_start=False)
    assert [v for v in range(26) if is_due(every, v, final=v == 25)] == [10, 20, 25]
    assert not is_due(PeriodicEvalConfig(), 0, final=True)  # no benchmarks: off


def test_builtin_heldout_prompts_are_not_training_prompts():
    data = DataConfig()
    cfg = PeriodicEvalConfig(benchmarks=["heldout"], limit=200)
    sets = heldout_sets(cfg, data)
    assert list(sets) == ["builtin"]  # named after the task
    train = {r.prompt for r in load_dataset(data).records}
    prompts = [r.prompt for r in sets["builtin"]]
    assert len(prompts) == 200 and len(set(prompts)) == 200 and not train & set(prompts)
    # a file dataset has no held-out split: skipped, and the trainer asks for nothing
    file_data = DataConfig(name="gsm8k", task="gsm8k", source="file", path="x.jsonl")
    assert heldout_sets(cfg, file_data) == {} and planned(cfg, file_data) == []


def test_point_metrics_are_avg_at_n_and_pass_at_k():
    from megatron_darl.eval.config import EvalConfig
    from megatron_darl.eval.harness import evaluate_benchmark
    from megatron_darl.rollout.engines.base import Generation
    import torch

    class Echo:  # answers "answer: 3" to the first prompt, nonsense to the second
        def generate(self, prompts, sampling):
            out = []
            for i, _ in enumerate(prompts):
                text = "answer: 3" if i == 0 else "no"
                ids = torch.tensor([ord(c) for c in text])
                out.append([Generation(token_ids=ids, logprobs=torch.zeros(len(ids)), finish_reason="stop")
                            for _ in range(sampling.n)])
            return out

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    records = [r for r in load_dataset(DataConfig()).records if r.reference == "3"][:1]
    records += [r for r in load_dataset(DataConfig()).records if r.reference == "5"][:1]
    result = evaluate_benchmark("builtin", records, Echo(), Tok(), EvalConfig(n=2, progress=False))
    from dataclasses import asdict

    metrics = point_metrics({"version": 3, "seconds": 1.5, "results": {"builtin": asdict(result)}})
    assert metrics["heldout/builtin/avg@2"] == 0.5 and metrics["heldout/builtin/pass@2"] == 0.5
    assert metrics["heldout/builtin/prompts"] == 2 and metrics["heldout_seconds"] == 1.5


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def read(self, key):
        return self.kv.get(key)

    def check(self, keys):
        return all(k in self.kv for k in keys)


def test_requests_skip_logged_versions_and_time_out_in_one_line(caplog):
    store = _Store()
    cfg = PeriodicEvalConfig(benchmarks=["heldout"], every_n_steps=2, timeout_s=0.05)
    requests = HeldoutRequests(cfg, steps=5, store=store, logged=[2])
    asked = [v for v in range(6) if requests.request(v)]
    assert asked == [0, 4, 5]  # 2 was logged by the run before the resume
    assert request_key(0) in store.kv and request_key(2) not in store.kv
    store.set(result_key(0), json.dumps({"version": 0, "seconds": 0.1, "results": {}}))
    store.set(result_key(4), json.dumps({"version": 4, "error": "RuntimeError: engine"}))
    assert [p["version"] for p in requests.poll()] == [0]
    assert requests.drain(wait=True) == [] and not requests.pending  # 5 never came: deadline
    assert "no result for version 5" in caplog.text and "version 4 not scored: RuntimeError" in caplog.text


def test_a_requested_version_the_worker_went_past_is_named_at_once_not_waited_for(caplog, monkeypatch):
    """A worker that comes to a weight sync late loads the next offer's newer version: a due
    version it went past must reach the trainer as not scored right away, so the run's end does
    not wait eval.timeout_s (600 s) for a point that cannot come."""
    import megatron_darl.loop.heldout_eval as heldout_eval

    store = _Store()
    cfg = PeriodicEvalConfig(benchmarks=["heldout"], every_n_steps=2, timeout_s=600)
    requests = HeldoutRequests(cfg, steps=4, store=store)
    scored = []
    monkeypatch.setattr(heldout_eval, "score_version", lambda v, *a: scored.append(v) or {
        "version": v, "seconds": 0.1, "results": {}})
    server = HeldoutServer(cfg, {"builtin": ["p"]}, None, None, None, connect=lambda: store)
    for version in (0, 1, 2, 3, 4):
        requests.request(version)
    for loaded in (0, 1, 3, 4):  # the engine went from version 1 to 3
        server(loaded)
    assert scored == [0, 4] and server.missed == [2]
    start = time.monotonic()
    points = requests.drain(wait=True)
    assert time.monotonic() - start < 1.0 and [p["version"] for p in points] == [0, 4]
    assert "version 2 not scored: rollout worker 0 went from version 1 to 3 without loading it" in caplog.text
    # a resumed worker's first version leaves nothing behind it; an answered version is kept
    later = HeldoutServer(cfg, {"builtin": ["p"]}, None, None, None, connect=lambda: store)
    later(3)
    assert later.missed == [] and json.loads(store.read(result_key(2)))["version"] == 2


def test_logger_keeps_points_apart_from_steps_and_across_a_resume(tmp_path):
    from megatron_darl.loop.config import LoopConfig
    from megatron_darl.loop.metrics import MetricsLogger, is_heldout

    loop = LoopConfig(steps=4, run_dir=str(tmp_path), progress_bar=False, plot=False, tensorboard=True)
    point = lambda v: {"version": v, "seconds": 0.2, "results": {"builtin": {  # noqa: E731
        "n": 1, "avg_at_n": 0.25 * v / 4, "pass_at_k": {"pass@1": 0.25 * v / 4}, "num_prompts": 8,
        "mean_response_tokens": 9.0, "truncated_fraction": 0.0}}}
    logger = MetricsLogger(loop)
    logger.log(0, {"samples_received": 4.0, "reward_mean": 0.5})
    logger.log_heldout(point(0))
    logger.log(1, {"samples_received": 4.0, "reward_mean": 0.5})
    logger.log_heldout(point(2))
    logger.log(2, {"samples_received": 4.0, "reward_mean": 0.5})
    summary = logger.close()
    assert summary["steps"] == 3 and [p["version"] for p in summary["heldout"]] == [0, 2]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], is_heldout(r)) for r in rows] == [(0, False), (0, True), (1, False), (2, True), (2, False)]
    assert rows[3]["heldout/builtin/avg@1"] == 0.125 and rows[3]["version"] == 2
    # a resume at step 2 (version 2): steps 2.. run again; the points of versions <= 2 stay
    again = MetricsLogger(loop, start_step=2)
    assert again.heldout_versions == [0, 2] and [int(r["step"]) for r in again.history] == [0, 1]
    again.log(2, {"samples_received": 4.0})
    again.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(is_heldout(r) for r in rows) == 2 and [r["step"] for r in rows if not is_heldout(r)] == [0, 1, 2]
