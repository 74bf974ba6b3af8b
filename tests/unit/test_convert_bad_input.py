"""Every bad input of both converters: exit code 1, one stderr line naming the value and file,
and no output (or temporary) directory left behind. Runs the tools' ``main`` in-process: the
checks happen before any rank is spawned, so these need no Megatron and no processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_darl.models.qwen3 import spec_from_hf
from megatron_darl.models.qwen3.mapping import hf_tensor_shapes
from megatron_darl.checkpoint.model_io import CheckpointMetadata, write_metadata
from tools import convert_hf_to_megatron as to_mg
from tools import convert_megatron_to_hf as to_hf

CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=256, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
    rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=128,
)


def _hf_dir(path: Path, config: dict = CONFIG, split: bool = True) -> Path:
    """A valid tiny HF checkpoint: two safetensors shards and an index."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    tensors = {n: torch.zeros(s) for n, s in hf_tensor_shapes(spec_from_hf(config)).items()}
    names = sorted(tensors)
    parts = [names[: len(names) // 2], names[len(names) // 2:]] if split else [names]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i}.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _mg_dir(path: Path) -> Path:
    """A structurally valid checkpoint dir (metadata + a real torch DCP shard, no Megatron)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "no process group: saving in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.randn(64, 8), "b": torch.randn(4)}, checkpoint_id=str(path))
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    write_metadata(path, CheckpointMetadata(hf_config=CONFIG, padded_vocab_size=256,
                                            dtype="float32", saved_tp=2, saved_pp=2))
    return path


def _run(tool, argv, capsys, out: Path, *needles: str) -> None:
    code = tool.main(argv + ["--out-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith(f"{tool.PROG}: error: "), err
    for needle in needles:
        assert needle in err[0], err[0]
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def _mutate_hf(tmp_path: Path, case: str) -> tuple[Path, list[str], tuple[str, ...]]:
    hf = _hf_dir(tmp_path / "hf", split=case != "truncated")
    cfg_file = str(hf / "config.json")
    if case == "missing_dir":
        return tmp_path / "nope", [], ("nope", "does not exist")
    if case == "missing_config":
        (hf / "config.json").unlink()
        return hf, [], (cfg_file, "missing")
    if case == "corrupt_config":
        (hf / "config.json").write_text("{not json")
        return hf, [], (cfg_file, "corrupt JSON")
    if case == "llama":
        cfg = dict(CONFIG, architectures=["LlamaForCausalLM"], model_type="llama")
        (hf / "config.json").write_text(json.dumps(cfg))
        return hf, [], (cfg_file, "LlamaForCausalLM", "supported: Qwen3ForCausalLM")
    if case == "missing_shard":
        (hf / "model-1.safetensors").unlink()
        return hf, [], (str(hf / "model-1.safetensors"), "missing")
    if case == "truncated":
        path = hf / "model-0.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
        return hf, [], (str(path), "corrupt safetensors")
    if case == "wrong_shape":
        cfg = dict(CONFIG, intermediate_size=96)
        (hf / "config.json").write_text(json.dumps(cfg))
        return hf, [], ("mlp.", "shape", "config says")
    if case == "missing_tensor":
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        (hf / "model.safetensors.index.json").unlink()
        keep = [n for n, f in index["weight_map"].items() if f == "model-0.safetensors"]
        (hf / "model-1.safetensors").unlink()
        assert keep
        return hf, [], ("missing from the checkpoint", str(hf))
    flags = {"tp_heads": ["--tp", "3"], "tp_groups": ["--tp", "4"], "pp_layers": ["--pp", "8"]}
    msgs = {"tp_heads": ("tp=3", "num_attention_heads=4", cfg_file),
            "tp_groups": ("tp=4", "num_key_value_heads", cfg_file),
            "pp_layers": ("pp=8", "num_hidden_layers=4", cfg_file)}
    return hf, flags[case], msgs[case]


@pytest.mark.parametrize("case", [
    "missing_dir", "missing_config", "corrupt_config", "llama", "missing_shard", "truncated",
    "wrong_shape", "missing_tensor", "tp_heads", "tp_groups", "pp_layers",
])
def test_hf_to_megatron_rejects(case, tmp_path, capsys):
    hf, flags, needles = _mutate_hf(tmp_path, case)
    _run(to_mg, ["--hf-dir", str(hf)] + flags, capsys, tmp_path / "out", *needles)


def test_hf_to_megatron_refuses_a_non_empty_out_dir(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    assert to_mg.main(["--hf-dir", str(hf), "--out-dir", str(out)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "user data"


@pytest.mark.parametrize("case", [
    "missing_dir", "no_metadata", "corrupt_metadata", "missing_shard", "truncated_shard",
    "tp_heads", "pp_layers", "llama",
])
def test_megatron_to_hf_rejects(case, tmp_path, capsys):
    mg = _mg_dir(tmp_path / "mg")
    meta_file = str(mg / "megatron_darl.json")
    shard = mg / "__0_0.distcp"
    flags: list[str] = []
    if case == "missing_dir":
        mg, needles = tmp_path / "nope", ("nope", "does not exist")
    elif case == "no_metadata":
        (mg / "megatron_darl.json").unlink()
        needles = (meta_file, "missing")
    elif case == "corrupt_metadata":
        (mg / "megatron_darl.json").write_text("[1, 2")
        needles = (meta_file, "corrupt")
    elif case == "missing_shard":
        shard.unlink()
        needles = (str(shard), "missing")
    elif case == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[:100])
        needles = (str(shard), "truncated")
    elif case == "llama":
        data = json.loads((mg / "megatron_darl.json").read_text())
        data["hf_config"]["architectures"] = ["LlamaForCausalLM"]
        (mg / "megatron_darl.json").write_text(json.dumps(data))
        needles = (meta_file, "LlamaForCausalLM")
    else:
        flags = ["--tp", "3"] if case == "tp_heads" else ["--pp", "5"]
        needles = ("tp=3", meta_file) if case == "tp_heads" else ("pp=5", meta_file)
    _run(to_hf, ["--megatron-dir", str(mg)] + flags, capsys, tmp_path / "out", *needles)
