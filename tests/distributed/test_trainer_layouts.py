"""The policy trainer gives the same log-probs and the same update at every TP/PP/DP layout.

One gloo launch per world size (see ``procs/trainer_procs.py``), all layouts from the same HF
weights and the same global batch (DP replicas take interleaved shards of it):

  2 procs: DP2 (log-probs, step 1, checkpoints in both optimizer formats, step 2 straight),
           then TP2 (also resumes the fully-reshardable checkpoint: TP1DP2 -> TP2DP1), then PP2
  1 proc : TP1 (log-probs, step 1, then resume from the DP2 checkpoint and step 2)
  4 procs: TP2PP2 (also a second trainer initialised from the checkpoint)

Tolerances (fp32, measured on CPU): log-probs vs HF transformers <= 1e-5 (seen ~1e-6);
parameters after one Adam step (lr 1e-3) <= 2e-5 (seen 3e-6 at TP2, 3e-7 at DP2); resumed
step 2 vs straight <= 1e-6 (seen 6e-8).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "procs"))
import trainer_procs  # noqa: E402

from megatron_darl.trainer.parallel import run_local_gloo  # noqa: E402

LAYOUTS = {  # name -> (tp, pp, world size); the order matters (see the fixture)
    "dp2": (1, 1, 2),
    "tp2": (2, 1, 2),
    "pp2": (1, 2, 2),
    "tp1": (1, 1, 1),
    "tp2pp2": (2, 2, 4),
}
LOGP_TOL = 1e-5
PARAM_TOL = 2e-5
RESUME_TOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("trainer_layouts")
    cfg_dict = trainer_procs.tiny_hf_config_dict()
    hf_kwargs = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    hf_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf_kwargs)).float().eval()
    hf_model.save_pretrained(root / "hf")
    ckpt = str(root / "ckpt_step1")
    plan: dict[int, list] = {}
    for name, (tp, pp, world) in LAYOUTS.items():
        save = ckpt if name == "dp2" else None
        load = {"tp1": ckpt, "tp2": ckpt + "_full"}.get(name)
        init = ckpt if name == "tp2pp2" else None
        plan.setdefault(world, []).append((tp, pp, str(root / f"{name}.pt"), save, load, init))
    for world, layouts in plan.items():  # dict order: world 2 (saves the checkpoint) first
        run_local_gloo(
            trainer_procs.layouts_worker, world, args=(str(root / "hf"), layouts), timeout_s=400,
        )
    out = {name: torch.load(root / f"{name}.pt", weights_only=False) for name in LAYOUTS}
    out["hf_logp"] = _hf_logprobs(hf_model)
    return out


def _hf_logprobs(model) -> torch.Tensor:
    batch = trainer_procs.make_batch()
    ref = torch.zeros(batch.num_tokens)
    offs = batch.offsets.tolist()
    with torch.no_grad():
        for i in range(batch.num_sequences):
            ids = batch.input_ids[offs[i] : offs[i + 1]]
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
            ref[offs[i] + 1 : offs[i + 1]] = logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    return ref[batch.loss_mask]  # the scored layout, as compute_logprobs returns it


def _full_logp(run: dict, which: int) -> torch.Tensor:
    """Reassemble the global batch's (scored-layout) log-probs from every DP replica's shard."""
    scored = [n - trainer_procs.PROMPT_LEN for n in trainer_procs.SEQ_LENS]
    offs = [0] + torch.cumsum(torch.tensor(scored), 0).tolist()
    full = torch.zeros(offs[-1])
    for _dp, shard, *logps in run["all_logp"]:
        idx = torch.cat([torch.arange(offs[i], offs[i + 1]) for i in shard])
        full[idx] = logps[which]
    return full


def _max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and len(a) == 1 + 4 * 11 + 1  # embed, 4 layers x 11, norm
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logprobs_match_hf_and_every_rank(runs, name):
    run = runs[name]
    assert float((_full_logp(run, 0) - runs["hf_logp"]).abs().max()) <= LOGP_TOL
    # each replica's ranks agree exactly (TP ranks and the PP broadcast)
    by_dp: dict[int, torch.Tensor] = {}
    for dp, _shard, logp0, _ in run["all_logp"]:
        if dp in by_dp:
            assert torch.equal(by_dp[dp], logp0)
        by_dp[dp] = logp0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hf_export_at_init_is_the_hf_checkpoint(runs, name):
    assert runs[name]["export0_vs_hf"] == 0.0


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "tp1"])
def test_one_step_same_update_as_tp1(runs, name):
    ref, run = runs["tp1"], runs[name]
    assert _max_param_diff(run["params1"], ref["params1"]) <= PARAM_TOL
    assert run["step1"].loss == pytest.approx(ref["step1"].loss, rel=1e-5, abs=1e-7)
    assert run["step1"].grad_norm == pytest.approx(ref["step1"].grad_norm, rel=1e-5)
    assert run["step1"].lr == ref["step1"].lr == pytest.approx(1e-3)
    assert run["step1"].stats["ratio_mean"] == pytest.approx(ref["step1"].stats["ratio_mean"], rel=1e-5)
    scored = sum(n - trainer_procs.PROMPT_LEN for n in trainer_procs.SEQ_LENS)
    assert run["step1"].num_loss_tokens == ref["step1"].num_loss_tokens == scored
    # the step moved the weights well beyond the tolerance
    assert float((_full_logp(run, 1) - _full_logp(ref, 0)).abs().max()) > 100 * LOGP_TOL
    assert float((_full_logp(run, 1) - _full_logp(ref, 1)).abs().max()) <= 10 * LOGP_TOL


def test_one_tensor_parallel_rank_runs_the_fused_layer(runs):
    """TP1 layouts (DP2, PP2's stages, TP1) run each decoder layer as one fused call
    (models/qwen3/fused_layer.py); TP2 layouts run Megatron's layer forward, so every comparison
    above between them and TP1 is also one between the two forwards."""
    assert {name: runs[name]["fused_layers"] for name in LAYOUTS} == {
        "dp2": 4, "tp2": 0, "pp2": 2, "tp1": 4, "tp2pp2": 0}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_step_is_timed_by_phase(runs, name):
    """``StepResult.phase_seconds`` (trainer/phases.py): forward/backward, the gradients' reduce
    over DP (``finalize_model_grads``) and the optimizer update, each timed, all within the step."""
    step = runs[name]["step1"]
    assert set(step.phase_seconds) == {"forward_backward", "grad_reduce", "optimizer"}, step.phase_seconds
    assert all(s > 0 for s in step.phase_seconds.values()), step.phase_seconds
    assert sum(step.phase_seconds.values()) <= step.seconds


@pytest.mark.parametrize("name", ["tp2", "pp2", "tp2pp2"])
def test_hub_batch_reaches_the_whole_replica(runs, name):
    assert runs[name]["broadcast_ok"] is True


def test_microbatches_split_by_token_budget(runs):
    assert runs["tp1"]["num_microbatches"] >= 3  # 8 sequences of up to 40 tokens, budget 96


def test_snapshot_logprobs_exact(runs):
    for name in LAYOUTS:
        run = runs[name]
        assert torch.equal(run["logp0_snapshot"], run["logp0"]), name
        assert torch.equal(run["logp1_after_swap"], run["logp1"]), name


def test_resume_at_other_dp_size(runs):
    straight, resumed = runs["dp2"], runs["tp1"]
    info = resumed["resumed"]
    assert (info.step, info.version, info.saved_dp_size) == (1, 1, 2)
    assert info.extra_states == [{"dp_rank": 0}, {"dp_rank": 1}]
    assert _max_param_diff(resumed["params2"], straight["params2"]) <= RESUME_TOL
    assert resumed["step2"].loss == pytest.approx(straight["step2"].loss, rel=1e-6)


def test_resume_at_other_tp_with_fully_reshardable_optimizer(runs):
    straight, resumed = runs["dp2"], runs["tp2"]
    assert resumed["resumed"].step == 1 and resumed["resumed"].extra_states == [None, None]
    assert _max_param_diff(resumed["params2"], straight["params2"]) <= PARAM_TOL
    assert resumed["step2"].loss == pytest.approx(straight["step2"].loss, rel=1e-5)
    assert "optim_sharding='fully_reshardable'" in resumed["errors"][-1]


def test_init_from_checkpoint_at_other_tp_pp(runs):
    # TP2PP2 trainer built by the production path from the DP2 (TP1PP1) step-1 checkpoint
    after_step1 = _full_logp(runs["dp2"], 1)
    assert float((runs["tp2pp2"]["logp_init_ckpt"] - after_step1).abs().max()) <= LOGP_TOL


def test_bad_input_errors_name_the_value(runs):
    too_long, bad_ids = runs["tp1"]["errors"][:2]
    assert "sequence 1" in too_long and "65 tokens" in too_long and "max_seq_len=64" in too_long
    assert "[0, 256)" in bad_ids
