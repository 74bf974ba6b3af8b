"""Unit tests of the trainer's configs, FLOP count, snapshots, checkpoint refusals and the
compiled-kernels switch."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_darl.models.qwen3.config import spec_from_hf
from megatron_darl.replay import VersionWindow
from megatron_darl.checkpoint.training import load_checkpoint
from megatron_darl.checkpoint.model_io import CheckpointMetadata, write_metadata
from megatron_darl.trainer.config import MicroBatchConfig, OptimizerConfig
from megatron_darl.trainer.flops import forward_flops, matmul_params, mfu, train_flops
from megatron_darl.trainer.snapshots import ParamSnapshots, room_for_snapshot

QWEN3_1_7B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="optimizer.lr"):
        OptimizerConfig(lr=0.0)
    with pytest.raises(ValueError, match="token_budget=1000 cannot hold one sequence"):
        MicroBatchConfig(token_budget=1000, max_seq_len=4096)


@pytest.mark.parametrize("name", ["default", "cpu_tiny"])
def test_trainer_yaml_presets_build(name):
    from pathlib import Path

    import yaml

    from megatron_darl.trainer.config import TrainerConfig

    root = Path(__file__).resolve().parents[2] / "configs" / "trainer"
    data = yaml.safe_load((root / "default.yaml").read_text())
    if name != "default":
        for key, value in yaml.safe_load((root / f"{name}.yaml").read_text()).items():
            if key != "defaults":
                data[key] = {**data[key], **value} if isinstance(value, dict) else value
    cfg = TrainerConfig(
        optimizer=OptimizerConfig(**data.pop("optimizer")),
        micro_batch=MicroBatchConfig(**data.pop("micro_batch")), **data,
    )
    assert cfg.micro_batch.token_budget >= cfg.micro_batch.max_seq_len


def test_flops_of_qwen3_1_7b():
    spec = spec_from_hf(QWEN3_1_7B)
    # 1.7B total minus the 311M embedding, plus the tied LM head counted as a matmul
    assert matmul_params(spec) == pytest.approx(1.72e9, rel=0.01)
    one = forward_flops(spec, [4096])
    attn = 4 * 28 * 2048 * 4096**2
    assert one == pytest.approx(2 * matmul_params(spec) * 4096 + attn)
    assert forward_flops(spec, [4096], causal=True) == pytest.approx(one - attn / 2)
    assert train_flops(spec, [4096, 4096]) == pytest.approx(6 * one)
    # per token: 6 N + 12 L H Q s, as benchmarks/model_step.py counts it
    per_token = 6 * matmul_params(spec) + 12 * 28 * 16 * 128 * 4096
    assert train_flops(spec, [4096]) / 4096 == pytest.approx(per_token)
    assert mfu(989e12, 1.0, 1, 989.0) == pytest.approx(1.0)


def test_snapshots_swap_and_restore():
    p = torch.nn.Parameter(torch.arange(4.0))
    snaps = ParamSnapshots([p], pin=False)
    snaps.take(0)
    with torch.no_grad():
        p.add_(10.0)
    snaps.take(1)
    snaps.retain([0, 1, 7])
    with snaps.swapped_in(0):
        assert p.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert p.tolist() == [10.0, 11.0, 12.0, 13.0]
    assert snaps.bytes() == 2 * 4 * 4 and snaps.versions == [0, 1]
    snaps.retain(VersionWindow(1).versions(1))
    with pytest.raises(ValueError, match="no parameter snapshot of version 0"):
        with snaps.swapped_in(0):
            pass


def test_resident_snapshots_swap_by_pointer_and_reuse_the_buffers_of_a_dropped_version():
    p = torch.nn.Parameter(torch.arange(4.0))
    live = p.data.data_ptr()
    snaps = ParamSnapshots([p], pin=False, placement="auto")  # CPU: resident whatever is asked
    snaps.take(0)
    with torch.no_grad():
        p.add_(10.0)
    snaps.take(1)
    assert snaps.resident_versions() == [0, 1]
    old = snaps._store[0][0].data_ptr()
    with snaps.swapped_in(0):
        assert p.data.data_ptr() == old and p.tolist() == [0.0, 1.0, 2.0, 3.0]  # no copy made
        loss = (p * 2).sum()  # a forward pass reads the snapshot
    assert loss.item() == 12.0
    assert p.data.data_ptr() == live and p.tolist() == [10.0, 11.0, 12.0, 13.0]
    assert snaps._store[0][0].tolist() == [0.0, 1.0, 2.0, 3.0]  # the snapshot is unchanged
    snaps.retain([1, 2])
    snaps.take(2)  # into version 0's buffers: no new allocation per step
    assert snaps._store[2][0].data_ptr() == old and snaps.versions == [1, 2]
    with pytest.raises(ValueError, match="trainer.snapshots='disk'"):
        ParamSnapshots([p], pin=False, placement="disk")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    spec = spec_from_hf(QWEN3_1_7B)
    other = dict(spec.to_dict(), hidden_size=64, num_layers=4)
    (tmp_path / "metadata.json").write_text("{}")  # dist_checkpointing's own file
    write_metadata(tmp_path, CheckpointMetadata(
        hf_config=QWEN3_1_7B, padded_vocab_size=151936, dtype="float32", saved_tp=1, saved_pp=1,
        model_spec=other, extra={"trainer": {"step": 3, "version": 3, "dp": 1}},
    ))
    trainer = SimpleNamespace(spec=spec)
    with pytest.raises(ValueError, match="checkpoint of another model.*hidden_size: checkpoint 64"):
        load_checkpoint(trainer, tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(trainer, tmp_path / "missing")


def test_lr_warmup_then_constant():
    from megatron_darl.trainer.optim import build_lr_scheduler

    groups = [{"lr": 0.0, "weight_decay": 0.0, "params": []}]
    opt = SimpleNamespace(param_groups=groups)
    sched = build_lr_scheduler(opt, OptimizerConfig(lr=1e-3, warmup_steps=4, weight_decay=0.1))
    seen = []
    for _ in range(6):  # the trainer advances the scheduler before each optimizer step
        sched.step(increment=1)
        seen.append(groups[0]["lr"])
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert groups[0]["weight_decay"] == pytest.approx(0.1)


def test_a_snapshot_stays_resident_when_only_the_allocators_cache_holds_the_memory():
    GiB = 2**30
    # an H200 (140 GiB): the allocator holds 120 GiB reserved, its peak use was 30 GiB, the
    # context 1 GiB. Counting the reserve as used sent the snapshot to the host; the peak keeps it
    assert room_for_snapshot(free=19 * GiB, total=140 * GiB, reserved=120 * GiB,
                             peak_allocated=30 * GiB, nbytes=3 * GiB, headroom=0.15)
    # the same device with a peak of 117 GiB has no room for 3 GiB more above a 15% margin
    assert not room_for_snapshot(free=19 * GiB, total=140 * GiB, reserved=120 * GiB,
                                 peak_allocated=117 * GiB, nbytes=3 * GiB, headroom=0.15)
    # another process (a colocated engine) holding 100 GiB counts against the room
    assert not room_for_snapshot(free=10 * GiB, total=140 * GiB, reserved=30 * GiB,
                                 peak_allocated=30 * GiB, nbytes=3 * GiB, headroom=0.15)


def test_compiled_kernels_switch_reaches_every_norm_and_is_in_the_default_config():
    import yaml

    from megatron_darl.models.qwen3.norm import Qwen3RMSNorm, rms_norm_reference
    from megatron_darl.trainer.config import TrainerConfig
    from megatron_darl.trainer.policy_trainer import compile_norms

    inner = Qwen3RMSNorm(hidden_size=4)
    chunks = [torch.nn.Sequential(Qwen3RMSNorm(hidden_size=8), torch.nn.Linear(8, 8)), torch.nn.Sequential(inner)]
    assert inner.compiled  # the default: compiled on GPU
    assert compile_norms(chunks, False) == 2
    assert not any(m.compiled for c in chunks for m in c.modules() if isinstance(m, Qwen3RMSNorm))
    x = torch.randn(3, 4)
    assert torch.equal(inner(x), rms_norm_reference(x, inner.weight, inner.eps))  # the eager arithmetic
    repo = Path(__file__).resolve().parents[2]
    defaults = yaml.safe_load((repo / "configs" / "trainer" / "default.yaml").read_text())
    assert defaults["compiled_kernels"] is True and TrainerConfig().compiled_kernels is True
