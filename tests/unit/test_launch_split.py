"""``cluster.split``: the split chooser on hand-made rates, the record reader, the config path."""

import json
import logging

import pytest

from launch import split as sp
from launch.config import load_run_config, save_run_config
from megatron_darl.loop.run_config import SplitRatesConfig


def rates(c=0.0, d=1e-3, work=1.0, a=0.0, b=1e-4) -> sp.Rates:
    return sp.Rates(trainer_fixed_s=c, trainer_shared_s=d, work=work, decode_s=a, decode_s_per_sample=b)


def request(n=4, groups=12, new_tokens=100, overlap=True, tp=1, model="qwen3_1.7b", **kw) -> sp.SplitRequest:
    return sp.SplitRequest(n_gpus=n, groups=groups, group_size=8, new_tokens=new_tokens, variant="darl",
                           overlap=overlap, tp=tp, model=model, **kw)


def steps(choice: sp.SplitChoice) -> dict[str, tuple[float, float, float]]:
    return {f"{c.trainer_gpus}:{c.rollout_gpus}": (c.trainer_s, c.generation_s, c.step_s) for c in choice.candidates}


# ------------------------------------------------------------------ the chooser

def test_trainer_bound_takes_more_trainer_gpus():
    # 96 samples x 100 tokens = 9600 tokens at 1 ms/token on one GPU: 9.6 s / T; generation 100 x 1e-4 x 96 / R
    choice = sp.choose_split(request(), rates(d=1e-3, b=1e-4), prompt_tokens=0)
    assert (choice.trainer_gpus, choice.rollout_gpus) == (3, 1)
    s = steps(choice)
    assert s["1:3"] == pytest.approx((9.6, 0.32, 9.6)) and s["2:2"] == pytest.approx((4.8, 0.48, 4.8))
    assert s["3:1"] == pytest.approx((3.2, 0.96, 3.2))


def test_generation_bound_takes_more_rollout_gpus():
    choice = sp.choose_split(request(), rates(d=1e-5, b=1e-3), prompt_tokens=0)
    assert (choice.trainer_gpus, choice.rollout_gpus) == (1, 3)
    assert steps(choice)["1:3"] == pytest.approx((0.096, 3.2, 3.2)) and steps(choice)["3:1"][2] == pytest.approx(9.6)


def test_fixed_engine_time_is_not_helped_by_more_engines_and_ties_go_to_rollout():
    # a memory-bound engine: 5 s per step whatever its batch; 2:2 and 3:1 both 5.0 s -> 2:2
    choice = sp.choose_split(request(), rates(d=1e-3, a=0.05, b=0.0), prompt_tokens=0)
    assert [c.step_s for c in choice.candidates] == pytest.approx([9.6, 5.0, 5.0])
    assert (choice.trainer_gpus, choice.rollout_gpus) == (2, 2)


def test_prompt_tokens_and_work_scale_the_trainer_and_sync_sums():
    # (100 + 50) tokens x 96 samples x work 2 x 1e-4 s/token = 2.88 s at T=1; sync: step = sum
    choice = sp.choose_split(request(overlap=False), rates(d=1e-4, work=2.0, b=1e-4), prompt_tokens=50)
    assert steps(choice)["1:3"] == pytest.approx((2.88, 0.32, 3.2))
    assert steps(choice)["2:2"] == pytest.approx((1.44, 0.48, 1.92))
    assert (choice.trainer_gpus, choice.rollout_gpus) == (2, 2)  # 3:1: 0.96 + 0.96 = 1.92 too: tie


def test_unshared_trainer_time_limits_scaling():
    r = rates(c=1e-4, d=2e-4)  # u(T) = 1e-4 + 2e-4 / T
    assert [r.trainer_tokens_per_s(t) for t in (1, 2, 4)] == pytest.approx([1 / 3e-4, 1 / 2e-4, 1 / 1.5e-4])


def test_layouts_tp2_forbids_odd_trainer_counts_and_each_dp_rank_needs_a_group():
    assert sp.valid_trainer_gpus(6, 2, 1, 8) == [2, 4]
    assert sp.valid_trainer_gpus(4, 1, 1, 8) == [1, 2, 3]  # DP 3 trains 8 groups as 3, 3 and 2
    assert sp.valid_trainer_gpus(4, 1, 1, 2) == [1, 2]  # 2 groups cannot feed 3 DP ranks
    choice = sp.choose_split(request(n=6, groups=8, tp=2), rates(d=1e-3, b=1e-4), prompt_tokens=0)
    assert [c.trainer_gpus for c in choice.candidates] == [2, 4] and choice.trainer_gpus == 4
    with pytest.raises(ValueError, match="cluster.split=auto"):
        sp.choose_split(request(n=2, tp=2), rates())


def test_why_line_names_the_choice_the_rates_and_their_sources():
    r = sp.Rates(0.0, 1e-3, 1.5, 0.0, 1e-4, "config cluster.rates (x T GPUs)", "default for darl", "prior: x")
    why = sp.choose_split(request(), r, prompt_tokens=0).why
    assert why.startswith("cluster.split=auto on 4 GPUs -> 3:1")
    for part in ("1:3 14.40 s", "1.0k/2.0k/3.0k tokens/s at 1/2/3 GPUs", "work x1.50 [default for darl]",
                 "[prior: x]", "12x8 samples of 0+100 tokens"):
        assert part in why, part


def test_fit_is_least_squares_with_nonnegative_coefficients():
    assert sp.fit_nonnegative([(1.0, 3.0), (2.0, 5.0)]) == pytest.approx((1.0, 2.0))
    # negative intercept -> through the origin: b = (32 + 192) / (32^2 + 64^2)
    assert sp.fit_nonnegative([(32.0, 1.0), (64.0, 3.0)]) == pytest.approx((0.0, 224 / 5120))
    assert sp.fit_nonnegative([(32.0, 5.5), (64.0, 5.3)]) == pytest.approx((5.4, 0.0))  # slower when smaller


def test_parse_split_names_the_field():
    assert sp.parse_split("3:1") == (3, 1)
    for bad in ("x:y", "4", "0:4", "1:2:1", "-1:5"):
        with pytest.raises(ValueError, match="cluster.split"):
            sp.parse_split(bad)


def test_gpu_name_reads_nvidia_smi_or_none():
    class Out:
        returncode, stdout = 0, "NVIDIA H200\n"

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    assert sp.gpu_name(lambda *a, **k: Out()) == "NVIDIA H200"
    assert sp.gpu_name(missing) is None


# ------------------------------------------------------------------ records

def record(tmp, name, *, model="qwen3_1.7b", engine="hf", device="NVIDIA H200", date="2026-01-02T00:00:00",
           t=1, r=1, layout=None, groups=8, tok_s=10000.0, gen_s=6.4, new_tokens=100, train=1.0, logprob=0.5,
           variant="darl", step=None, wait=0.0):
    cfg = {"model": model, "engine": engine, "variant": variant, "groups": groups, "group_size": 8,
           "new_tokens": new_tokens, "layout": layout or f"t{t}r{r}"}
    if layout is None:
        cfg.update(trainer_gpus=t, rollout_gpus=r)
    metrics = {"trainer_tokens_per_s": tok_s, "generation_seconds": gen_s, "train_seconds": train,
               "logprob_seconds": logprob}
    if step is not None:  # busy = step - receive wait (else the sum of the trainer's parts)
        metrics.update(step_seconds=step, receive_wait_seconds=wait)
    (tmp / f"loop_profile_{name}.json").write_text(json.dumps(
        {"benchmark": "loop_profile", "device": device, "date": date, "config": cfg, "metrics": metrics}))


@pytest.fixture
def results(tmp_path):
    record(tmp_path, "a", t=1, r=1, tok_s=10000.0, gen_s=6.4)  # 64 samples / engine: 0.064 s per decode step
    record(tmp_path, "b", t=2, r=2, tok_s=16000.0, gen_s=3.2, logprob=1.0, date="2026-01-03T00:00:00")
    record(tmp_path, "old", t=1, r=1, tok_s=1.0, gen_s=99.0, date="2025-01-01T00:00:00")  # replaced by a
    record(tmp_path, "model", model="qwen3_8b", t=1, r=3, tok_s=1.0, gen_s=99.0)
    record(tmp_path, "vllm", engine="vllm", t=1, r=3, tok_s=1.0, gen_s=99.0)
    record(tmp_path, "h100", device="NVIDIA H100 80GB HBM3", t=1, r=3, tok_s=1.0, gen_s=99.0)
    record(tmp_path, "shared", layout="gpu1", tok_s=1.0, gen_s=99.0)  # trainer and engine on one GPU
    record(tmp_path, "big", groups=64, t=1, r=3, tok_s=1.0, gen_s=99.0)  # farther batch shape
    record(tmp_path, "decoupled", variant="decoupled", t=1, r=1, tok_s=1.0, gen_s=99.0, date="2026-02-01T00:00:00")
    return tmp_path


def test_reader_keeps_the_model_and_engine_and_separate_gpus(results):
    names = {r.path for r in sp.read_records(results, "qwen3_1.7b", "hf")}
    assert names == {f"loop_profile_{n}.json" for n in ("a", "b", "old", "h100", "big", "decoupled")}
    b = next(r for r in sp.read_records(results, "qwen3_1.7b", "hf") if r.path == "loop_profile_b.json")
    assert (b.trainer_gpus, b.rollout_gpus, b.samples_per_engine, b.work) == (2, 2, 32.0, 2.0)


def test_selection_prefers_the_device_the_shape_the_variant_and_the_newest(results):
    req = request(groups=8)
    recs = sp.read_records(results, "qwen3_1.7b", "hf")
    h200 = [r.path for r in sp.select_records(recs, req, "NVIDIA H200")]
    assert h200 == ["loop_profile_a.json", "loop_profile_b.json"]
    assert [r.path for r in sp.select_records(recs, req, "NVIDIA H100 80GB HBM3")] == ["loop_profile_h100.json"]
    assert sp.select_records(recs, req, None) == sp.select_records(recs, req, "NVIDIA H200")  # the newest's device
    decoupled = sp.SplitRequest(n_gpus=4, groups=8, group_size=8, new_tokens=100, variant="decoupled", overlap=True)
    assert [r.path for r in sp.select_records(recs, decoupled, None)] == ["loop_profile_decoupled.json",
                                                                          "loop_profile_b.json"]
    rates_ = sp.record_rates(sp.select_records(recs, req, "NVIDIA H200"), req)
    # u(1) = 1e-4, u(2) = 6.25e-5 s/token -> c = 2.5e-5, d = 7.5e-5; decode: 6.4 / 100 at 64, 3.2 / 100 at 32
    assert (rates_.trainer_fixed_s, rates_.trainer_shared_s) == pytest.approx((2.5e-5, 7.5e-5))
    assert (rates_.decode_s, rates_.decode_s_per_sample) == pytest.approx((0.0, 1e-3))
    assert rates_.work == 2.0 and rates_.work_source == "record loop_profile_b.json"  # the newest darl record


def test_decide_from_records_and_explicit_rates_override_them(results):
    req = request(groups=8)
    choice = sp.decide(req, SplitRatesConfig(prompt_tokens=28), device="NVIDIA H200", results_dir=results)
    # trainer: work 2 x 64 x 128 tokens x (2.5e-5 + 7.5e-5 / T); generation 100 x 1e-3 x 64 / R
    assert steps(choice)["1:3"] == pytest.approx((1.6384, 6.4 / 3, 6.4 / 3))
    assert steps(choice)["2:2"] == pytest.approx((1.024, 3.2, 3.2))
    assert (choice.trainer_gpus, choice.rollout_gpus) == (1, 3) and "records loop_profile_a.json" in choice.why
    fixed = SplitRatesConfig(prompt_tokens=28, engine_decode_s=0.012, results_dir=str(results))
    choice = sp.decide(req, fixed, device="NVIDIA H200")  # engine 1.2 s whatever R: the trainer decides
    assert [c.step_s for c in choice.candidates] == pytest.approx([1.6384, 1.2, 1.2])  # 3:1 ties 2:2
    assert (choice.trainer_gpus, choice.rollout_gpus) == (2, 2) and "engine 100 x (12 + 0 x" in choice.why


def test_measured_steps_win_and_calibrate_the_predictions(tmp_path):
    record(tmp_path, "a", t=1, r=1, tok_s=10000.0, gen_s=6.4, step=9.6, wait=8.1)
    record(tmp_path, "b", t=2, r=2, tok_s=16000.0, gen_s=3.2, step=2.0, wait=0.0, date="2026-01-03T00:00:00")
    record(tmp_path, "c", t=1, r=3, tok_s=10000.0, gen_s=1.0, step=0.5, new_tokens=200)  # other shape: not a step
    req = request(groups=8)
    assert [r.work for r in sp.read_records(tmp_path, "qwen3_1.7b", "hf")] == pytest.approx([1.5, 2.0, 0.5])
    choice = sp.decide(req, SplitRatesConfig(prompt_tokens=28, results_dir=str(tmp_path)), device="NVIDIA H200")
    # predicted (work 2 of b): 1:1 max(1.6384, 6.4) = 6.4 -> a measured 9.6: x1.5; 2:2 3.2 -> b 2.0: x0.625;
    # mean 1.0625; 1:3 max(1.6384, 6.4 / 3) = 2.1333 x 1.0625 = 2.2667 against 2:2's measured 2.0
    by_split = {f"{c.trainer_gpus}:{c.rollout_gpus}": c for c in choice.candidates}
    assert by_split["1:3"].step_s == pytest.approx(6.4 / 3 * 1.0625) and by_split["1:3"].measured == ""
    assert by_split["2:2"].step_s == 2.0 and by_split["2:2"].measured == "loop_profile_b.json"
    assert (choice.trainer_gpus, choice.rollout_gpus) == (2, 2)
    assert "2:2 2.00 s measured [loop_profile_b.json]" in choice.why and "x1.06 calibrated" in choice.why
    # a rate given in the config: its model alone decides (no measured steps, no calibration)
    given = sp.decide(req, SplitRatesConfig(prompt_tokens=28, trainer_work=2.0, results_dir=str(tmp_path)))
    assert [c.measured for c in given.candidates] == ["", "", ""]
    assert [c.step_s for c in given.candidates] == pytest.approx([6.4 / 3, 3.2, 6.4]) and given.trainer_gpus == 1


def test_one_engine_batch_size_assumes_half_fixed(tmp_path):
    record(tmp_path, "a", t=1, r=1, gen_s=6.4)
    recs = sp.select_records(sp.read_records(tmp_path, "qwen3_1.7b", "hf"), request(groups=8), None)
    r = sp.record_rates(recs, request(groups=8))
    assert (r.decode_s, r.decode_s_per_sample) == pytest.approx((0.032, 0.032 / 64))
    assert r.trainer_fixed_s == 0.0 and r.trainer_shared_s == pytest.approx(1e-4)  # one T: linear scaling


def test_unreadable_record_names_the_file(tmp_path):
    (tmp_path / "loop_profile_bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="loop_profile_bad.json"):
        sp.read_records(tmp_path, "m", "hf")


def test_prior_without_records_and_without_a_shape(tmp_path):
    shape = (("hidden_size", 2048), ("intermediate_size", 6144), ("num_hidden_layers", 28),
             ("num_attention_heads", 16), ("num_key_value_heads", 8), ("head_dim", 128), ("vocab_size", 151936))
    req = request(groups=8, model="qwen3_1.7b", model_shape=shape)
    n = sp.matmul_params(dict(shape))
    assert n == 28 * (2048 * 128 * 48 + 3 * 2048 * 6144) + 2048 * 151936
    r = sp.prior_rates(req, "NVIDIA H200")
    assert r.trainer_tokens_per_s(1) == pytest.approx(989e12 * sp.PRIOR_MFU / (6 * n))
    assert r.decode_s == pytest.approx(2 * n / (4.8e12 * sp.PRIOR_BW_EFF) + 28 * sp.PRIOR_HF_LAYER_S)
    assert sp.decide(req, SplitRatesConfig(results_dir=str(tmp_path))).why.count("prior") == 2
    with pytest.raises(ValueError, match="cluster.rates or cluster.split"):
        sp.decide(request(groups=8, model="mine"), SplitRatesConfig(results_dir=str(tmp_path)))


# ------------------------------------------------------------------ the config path

EXPLICIT = ["cluster.rates.trainer_work=1.0", "cluster.rates.prompt_tokens=16", "sampling.max_new_tokens=48"]


def test_auto_on_gpu4_sets_ranks_workers_devices_and_transport(caplog, tmp_path, monkeypatch):
    monkeypatch.setattr(sp, "visible_gpus", lambda: pytest.fail("gpu4 gives the count"))
    with caplog.at_level(logging.INFO, logger="launch.split"):  # generation-bound -> 1:3
        cfg = load_run_config(["cluster=gpu4", "cluster.split=auto", "cluster.rates.trainer_tokens_per_s=1e9",
                               "cluster.rates.engine_decode_s_per_sample=1e-3", *EXPLICIT])
    c = cfg.cluster
    assert (c.split, c.trainer_gpus, c.rollout_gpus) == ("1:3", 1, 3)
    assert (c.trainer_ranks, c.rollout_workers, c.trainer_devices, c.rollout_devices) == (1, 3, [0], [1, 2, 3])
    assert (cfg.topology.workers, cfg.topology.hubs) == (3, 1)
    assert "cluster.split=auto on 4 GPUs -> 1:3" in caplog.text and "config cluster.rates" in caplog.text
    # the saved config says 1:3, and its children never decide again
    path = save_run_config(cfg, tmp_path / "run_config.yaml")
    assert "split: '1:3'" in path.read_text() and "split: auto" not in path.read_text()
    monkeypatch.setattr(sp, "decide", lambda *a, **k: pytest.fail("a child decided again"))
    again = load_run_config(config_file=path)
    assert again.cluster.split == "1:3" and again.cluster.rollout_devices == [1, 2, 3]


@pytest.mark.parametrize("groups, split", [(2, "2:2"), (12, "3:1"), (32, "3:1")])
def test_auto_trainer_bound_takes_the_largest_valid_trainer(groups, split):
    cfg = load_run_config(["cluster=gpu4", "cluster.split=auto", "cluster.rates.trainer_tokens_per_s=1000",
                           "cluster.rates.engine_decode_s_per_sample=1e-6", f"algorithm.groups_per_step={groups}",
                           f"worker.groups_per_batch={groups}", *EXPLICIT])
    t = int(split[0])
    assert cfg.cluster.split == split and cfg.cluster.trainer_devices == list(range(t))
    assert cfg.topology.hubs == t and cfg.topology.workers == 4 - t


def test_auto_with_the_default_model_on_gpu4_resolves():
    cfg = load_run_config(["cluster=gpu4", "cluster.split=auto"])  # what --print-config shows on a CPU box
    t, r = map(int, cfg.cluster.split.split(":"))
    assert t + r == 4 and cfg.cluster.trainer_ranks == t and cfg.cluster.rollout_workers == r


def test_explicit_split_is_the_counts():
    cfg = load_run_config(["cluster=gpu4", "cluster.split=1:3"])
    assert (cfg.cluster.trainer_devices, cfg.cluster.rollout_devices) == ([0], [1, 2, 3])
    assert cfg.topology.workers == 3


@pytest.mark.parametrize("overrides, match", [
    (["cluster=gpu4", "cluster.split=5:1"], "cluster.split='5:1' needs 6 GPUs"),
    (["cluster=gpu4", "cluster.split=x:y"], "cluster.split='x:y'"),
    (["cluster=gpu4", "cluster.split=4:0"], "cluster.split='4:0'"),
    (["cluster.split=auto"], "cluster.split=auto needs >= 2 GPUs"),  # cluster=local, no GPU visible
    (["cluster=gpu4", "cluster.split=auto", "cluster.rates.trainer_work=-1"], "cluster.rates.trainer_work"),
])
def test_bad_values_name_the_field(overrides, match, monkeypatch):
    monkeypatch.setattr(sp, "visible_gpus", lambda: 0)
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        load_run_config(overrides)


def test_explicit_split_beyond_the_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(sp, "visible_gpus", lambda: 2)
    with pytest.raises(ValueError, match="cluster.split='2:2' needs 4 GPUs but 2 are visible"):
        load_run_config(["cluster.split=2:2"])
