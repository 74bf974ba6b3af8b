"""Metrics: DP reduction of the typed step statistics, derived values, jsonl round trip,
TensorBoard, plot, summary."""

import dataclasses
import json
import math

import pytest
import torch

from megatron_darl.loop.config import LoopConfig, WandbConfig
from megatron_darl.loop.metrics import MetricsLogger, step_metrics
from megatron_darl.step.stats import Reduction, StepStats


def shard_sums(seed):
    g = torch.Generator().manual_seed(seed)
    score = float(torch.rand(1, generator=g))
    return StepStats(
        reward_sum=3.0 + seed, samples_received=8.0, response_tokens_received=40.0,
        groups_received=2.0, staleness_hist=torch.tensor([1.0, 1.0, 0.0]),
        selected_hist=torch.tensor([2.0, 0.0, 0.0]), groups_selected=2.0,
        samples_selected=8.0, selected_score_sum=0.5, w_sum=30.0, w_sq_sum=36.0,
        w_tokens=30.0, w_clipped=1.0, mismatch_k3_sum=0.3, mismatch_tokens=30.0,
        cache_bytes=1024.0, score_sum=score + 0.25, score_count=2.0, score_max=max(score, 0.25),
        selected_staleness_max=float(seed),
    )


def test_step_stats_declare_their_reduction_and_reduce_across_two_shards():
    a, b = shard_sums(0), shard_sums(1)
    seen = {}

    def capture(name):  # rank b's packed vectors, as a collective would see them
        def op(t):
            seen[name] = t.clone()
            return t
        return op

    b.reduce(capture("sum"), capture("max"))
    total = a.reduce(lambda t: t + seen["sum"], lambda t: torch.maximum(t, seen["max"]))
    assert total.reward_sum == 7.0 and total.samples_received == 16.0
    assert torch.equal(total.staleness_hist, torch.tensor([2.0, 2.0, 0.0], dtype=torch.float64))
    assert total.score_max == max(a.score_max, b.score_max) and total.selected_staleness_max == 1.0
    assert a.reduce(lambda t: None, lambda t: None).reward_sum == 3.0  # in-place ops return None
    maxima = {f.name for f in dataclasses.fields(StepStats) if f.metadata["reduce"] is Reduction.MAX}
    assert maxima == {"score_max", "selected_staleness_max", "times_selected_max"}


def test_step_metrics_values():
    m = step_metrics(shard_sums(0), {"clip_frac_low": 0.1, "trainer_tokens_per_s": 100.0})
    assert m["reward_mean"] == pytest.approx(3.0 / 8)
    assert m["response_length"] == 5.0
    assert m["weight_ess"] == pytest.approx(30.0 ** 2 / (30 * 36))
    assert m["mismatch_kl"] == pytest.approx(0.01)
    assert m["staleness_hist"] == [1.0, 1.0, 0.0] and m["staleness_mean"] == 0.5
    assert m["selected_mean"] == 0.0 and m["clip_frac_low"] == 0.1
    empty = step_metrics(StepStats.empty(3))
    assert all(math.isfinite(v) for v in empty.values() if isinstance(v, float))


def test_logger_writes_round_trips_plots_and_resumes(tmp_path, caplog):
    cfg = LoopConfig(steps=6, run_dir=str(tmp_path / "run"), progress_bar=False,
                     wandb=WandbConfig(mode="offline"))
    logger = MetricsLogger(cfg, {"algorithm": {"variant": "darl"}})
    written = []
    for step in range(4):
        sums = shard_sums(step)
        written.append(logger.log(step, step_metrics(sums, {"loss": 0.5, "weight_sync_seconds": 0.01})))
    summary = logger.close()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == written and [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        for v in r.values():
            for x in (v if isinstance(v, list) else [v]):
                assert isinstance(x, (int, float)) and math.isfinite(x)
    assert (tmp_path / "run" / "progress.png").stat().st_size > 1000
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents*"))
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk == summary
    assert summary["steps"] == 4 and summary["samples_generated"] == 32
    assert summary["reward_first"] == pytest.approx(3 / 8) and summary["reward_last"] == pytest.approx(6 / 8)
    assert summary["wall_seconds"] >= 0
    # resume at step 2: steps 2-3 are rewritten, cumulative counters continue from step 1
    logger = MetricsLogger(cfg, start_step=2)
    logger.log(2, step_metrics(shard_sums(9)))
    summary = logger.close()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and summary["samples_generated"] == 24
    assert summary["steps"] == 3


def test_nonfinite_values_become_null(tmp_path):
    cfg = LoopConfig(steps=1, run_dir=str(tmp_path), progress_bar=False, tensorboard=False, plot=False)
    logger = MetricsLogger(cfg)
    rec = logger.log(0, {"loss": float("nan"), "reward_mean": 1.0, "samples_received": 1.0})
    logger.close()
    assert rec["loss"] is None
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] is None


def test_a_step_that_trained_no_sample_is_named_once_then_every_hundredth(tmp_path, caplog):
    cfg = LoopConfig(steps=250, run_dir=str(tmp_path), progress_bar=False, tensorboard=False, plot=False)
    logger = MetricsLogger(cfg)
    idle = {"samples_selected": 0.0, "buffer_groups": 16.0, "reward_mean": 0.0, "groups_received": 8.0}
    with caplog.at_level("WARNING", logger="megatron_darl.loop.metrics"):
        logger.log(0, {**idle, "samples_selected": 64.0})  # a step that trained
        for step in range(1, 200):  # 199 idle steps: the 1st and the 100th are named
            logger.log(step, idle)
    logger.close()
    said = [r.getMessage() for r in caplog.records if "trained no sample" in r.getMessage()]
    assert len(said) == 2
    assert said[0].startswith("step 1 trained no sample (1 such step(s)") and "16 groups in the buffer" in said[0]
    assert "replay.drop_degenerate" in said[0] and "mean reward 0.000" in said[0]
    assert said[1].startswith("step 100 trained no sample (100 such step(s)")
