"""Hostile paths for the converters: an output that overlaps the input, ``--force`` on foreign data.

The tools run for real (``main`` in-process; the one conversion that goes through spawns its gloo
rank as usual) on a real tiny HF checkpoint; each case checks that the input is intact after.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from tools import convert_hf_to_megatron as to_mg
from tools import convert_megatron_to_hf as to_hf
from tools.conversion import MANIFEST_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_convert_bad_input import _hf_dir  # noqa: E402 (a valid tiny HF checkpoint)


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


def _refused(tool, argv, capsys, *needles) -> str:
    code = tool.main(argv + ["--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


@pytest.mark.fault(kind="file", name="converter --out-dir overlapping the input, with --force")
@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_an_overlapping_out_dir_is_refused_and_the_input_kept(tmp_path, capsys, where, fault_record):
    """Both converters refuse an --out-dir equal to, above or inside the input, even with --force; the input is intact."""
    (tmp_path / "models").mkdir()
    hf = _hf_dir(tmp_path / "models" / "hf")
    before = _digest(hf)
    out = {"same": hf, "parent": tmp_path / "models", "inside": hf / "mg"}[where]
    word = {"same": "itself", "parent": "contains", "inside": "is inside"}[where]
    line = _refused(to_mg, ["--hf-dir", str(hf), "--out-dir", str(out), "--force"], capsys, word, "--hf-dir")
    _refused(to_hf, ["--megatron-dir", str(hf), "--out-dir", str(out), "--force"], capsys, word, "--megatron-dir")
    assert _digest(hf) == before and not (hf / "mg").exists()
    fault_record["observed"] = line[:200]


@pytest.mark.fault(kind="file", name="converter --force on a directory it did not write")
def test_force_removes_only_what_a_previous_conversion_wrote(tmp_path, capsys, fault_record):
    """--force refuses a directory with files no conversion wrote, and replaces exactly an earlier conversion's output."""
    hf = _hf_dir(tmp_path / "hf")
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    _refused(to_mg, ["--hf-dir", str(hf), "--out-dir", str(user), "--force"], capsys, "not written by a conversion")
    assert (user / "notes.txt").read_text() == "mine"
    out = tmp_path / "mg"
    assert to_mg.main(["--hf-dir", str(hf), "--out-dir", str(out), "--no-progress"]) == 0
    assert (out / "conversion_manifest.json").is_file() and (out / "megatron_darl.json").is_file()
    (out / "mine.txt").write_text("keep me")
    _refused(to_mg, ["--hf-dir", str(hf), "--out-dir", str(out), "--force"], capsys, "mine.txt",
             "did not write")
    (out / "mine.txt").unlink()
    assert to_mg.main(["--hf-dir", str(hf), "--out-dir", str(out), "--force", "--no-progress"]) == 0
    assert (out / "megatron_darl.json").is_file()
    capsys.readouterr()
    fault_record["observed"] = "refused (user files named, untouched); an earlier conversion was replaced"


@pytest.mark.fault(kind="file", name="converter --force with a manifest naming files outside --out-dir")
@pytest.mark.parametrize("entry", ["parent", "absolute", "symlink"])
def test_force_deletes_nothing_outside_the_out_dir(tmp_path, capsys, entry, fault_record):
    """--force refuses a manifest entry outside --out-dir (a `..` path, an absolute path, a symlinked directory), naming it; nothing is deleted."""
    hf = _hf_dir(tmp_path / "hf")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    out = tmp_path / "mg"
    out.mkdir()
    (out / "model.bin").write_text("an earlier conversion")
    listed = {"parent": "../victim/precious.txt", "absolute": str(victim / "precious.txt"),
              "symlink": "link/precious.txt"}[entry]
    if entry == "symlink":
        (out / "link").symlink_to(victim, target_is_directory=True)
    (out / MANIFEST_NAME).write_text(json.dumps({"tool": "x", "source": "y", "files": ["model.bin", listed]}))
    line = _refused(to_mg, ["--hf-dir", str(hf), "--out-dir", str(out), "--force"], capsys, repr(listed),
                    "not a file inside")
    assert (victim / "precious.txt").read_text() == "mine"
    assert (out / "model.bin").read_text() == "an earlier conversion"
    fault_record["observed"] = line[:200]


@pytest.mark.fault(kind="file", name="NaN in an HF model's embedding (HF -> Megatron)")
def test_nan_weights_of_an_hf_model_are_refused_not_converted(tmp_path, capsys, fault_record):
    """convert_hf_to_megatron refuses an HF model holding NaN in one line naming the weight and the directory; no output is left."""
    from safetensors.torch import load_file, save_file

    hf = _hf_dir(tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    shard = hf / index["model.embed_tokens.weight"]
    tensors = load_file(str(shard))
    tensors["model.embed_tokens.weight"][3, :5] = float("nan")
    save_file(tensors, str(shard))
    out = tmp_path / "mg"
    line = _refused(to_mg, ["--hf-dir", str(hf), "--out-dir", str(out)], capsys,
                    f"checkpoint {hf} is damaged: weight ", "(5 of ", "values are nan) after loading")
    assert not out.exists()
    fault_record["observed"] = line[:200]
