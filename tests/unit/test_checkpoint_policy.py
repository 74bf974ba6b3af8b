"""When the loop checkpoints between steps, and the checksum manifest a checkpoint carries."""

from __future__ import annotations

import json

import pytest

from megatron_darl.checkpoint.manager import CheckpointSchedule, newest_checkpoint
from megatron_darl.checkpoint.resume_points import complete_checkpoints
from megatron_darl.loop.config import LoopConfig
from megatron_darl.checkpoint.checksums import (
    MANIFEST_NAME, nonfinite_parameter, read_manifest, share, verify_checkpoint, write_manifest,
)


def test_by_time_a_small_first_save_follows_the_first_step_a_big_one_a_prior_speed():
    big = CheckpointSchedule(interval=None, overhead=0.02, last_end=100.0)
    assert not big.due(1, 0, 40, 32 * 10**9, now=101.0)  # 32 GB at 1 GB/s: 32 s / 0.02 = 1600 s
    assert not big.due(1, 0, 40, 32 * 10**9, now=100.0 + 1599.0)
    assert big.due(1, 0, 40, 32 * 10**9, now=100.0 + 1600.0)
    s = CheckpointSchedule(interval=None, overhead=0.02, last_end=100.0)
    assert not s.due(0, 0, 40, now=100.0)  # nothing trained yet
    assert s.due(1, 0, 40, 2 * 10**9, now=100.0)  # 2 GB (2 s at the prior): after the first step
    s.saved(0.4, nbytes=1000, now=101.0)
    assert not s.due(2, 0, 40, 1000, now=101.0 + 19.9)  # 0.4 s / 0.02 = 20 s
    assert s.due(2, 0, 40, 1000, now=101.0 + 20.0)
    assert not s.due(2, 0, 40, 2000, now=101.0 + 39.9)  # twice the bytes (the snapshots filled): 40 s
    assert s.due(2, 0, 40, 2000, now=101.0 + 40.0)
    assert not s.due(40, 0, 40, now=1e6)  # the final checkpoint comes anyway
    assert not s.due(5, 5, 40, now=1e6)  # resumed at 5: that checkpoint exists


def test_the_slowest_of_the_last_four_saves_sets_the_pace():
    s = CheckpointSchedule(interval=None, overhead=0.02, last_end=0.0)
    for seconds in (3.0, 1.0, 1.0, 1.0):
        s.saved(seconds, nbytes=100, now=0.0)
    assert s.expected_seconds(100) == 3.0
    s.saved(1.0, nbytes=100, now=0.0)  # the slow one leaves the window
    assert s.expected_seconds(100) == 1.0


def test_a_fixed_interval_and_off():
    every3 = CheckpointSchedule(interval=3, overhead=0.02)
    assert [s for s in range(10) if every3.due(s, 0, 10)] == [3, 6, 9]
    assert not any(CheckpointSchedule(interval=0, overhead=0.02).due(s, 0, 10) for s in range(10))
    assert not any(CheckpointSchedule(interval=None, overhead=0.0).due(s, 0, 10) for s in range(10))


def test_loop_config_defaults_and_checks():
    cfg = LoopConfig()
    assert (cfg.checkpoint_interval, cfg.checkpoint_overhead, cfg.keep_checkpoints) == (None, 0.015, 2)
    with pytest.raises(ValueError, match="loop.checkpoint_overhead"):
        LoopConfig(checkpoint_overhead=1.0)
    with pytest.raises(ValueError, match="loop.checkpoint_interval"):
        LoopConfig(checkpoint_interval=-1)


def test_share_balances_bytes_and_covers_every_file_once():
    sizes = {"a": 100, "b": 90, "c": 10, "d": 5, "e": 1}
    parts = [share(sizes, r, 2) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(sizes)
    assert parts == [["a", "d"], ["b", "c", "e"]]  # 105 and 101 bytes: largest first, to the least loaded


def _fake_checkpoint(root):
    (root / "extra").mkdir(parents=True)
    (root / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (root / "common.pt").write_bytes(b"common")
    (root / "extra" / "dp00000.pt").write_bytes(b"extra")
    (root / "megatron_darl.json").write_text("{}")
    return root


def test_manifest_round_trip_and_each_damage_named(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "step_000003")
    assert write_manifest(ckpt) == ""
    files = read_manifest(ckpt)
    assert sorted(files) == ["__0_0.distcp", "common.pt", "extra/dp00000.pt", "megatron_darl.json"]
    assert files["__0_0.distcp"]["bytes"] == 10240
    assert verify_checkpoint(ckpt) == ""
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.seek(5000)
        f.write(b"\xff" * 16)
    assert verify_checkpoint(ckpt).startswith(f"{ckpt / '__0_0.distcp'} does not match its checksum (sha256 ")
    (ckpt / "__0_0.distcp").write_bytes(b"short")
    assert verify_checkpoint(ckpt) == f"{ckpt / '__0_0.distcp'} is truncated (5 bytes, {MANIFEST_NAME} says 10240)"
    (ckpt / "__0_0.distcp").unlink()
    assert verify_checkpoint(ckpt) == f"{ckpt / '__0_0.distcp'} is missing"
    (ckpt / MANIFEST_NAME).write_bytes(b"\xff\xfe garbage")
    assert verify_checkpoint(ckpt).startswith(f"{ckpt / MANIFEST_NAME}: not a checksum manifest (")


def test_without_a_manifest_a_checkpoint_passes_and_is_still_a_resume_point(tmp_path):
    """A checkpoint written before checksums existed loads (its weights are still checked) and is
    a resume point: completeness is the final name and the marker (megatron_darl/checkpoint/resume_points.py), and a
    write seals the manifest before the rename, so a new final checkpoint always has one."""
    ckpt = _fake_checkpoint(tmp_path / "checkpoints" / "step_000001")
    assert verify_checkpoint(ckpt) == ""
    assert complete_checkpoints(tmp_path) == [ckpt]
    assert newest_checkpoint(tmp_path) == f"the newest checkpoint is {ckpt} (resume from it with loop.resume=true)"
    assert newest_checkpoint(tmp_path / "elsewhere").startswith("no checkpoint was written in ")
    assert write_manifest(ckpt) == ""
    assert json.loads((ckpt / MANIFEST_NAME).read_text())["algorithm"] == "sha256-of-block-sha256s"


def test_the_digest_is_of_the_blocks_digests_and_a_format_1_manifest_still_verifies(tmp_path, monkeypatch):
    """Format 2 hashes 64 MiB blocks on a pool of threads (a 1.7B checkpoint's 24-38 GB on one rank
    would otherwise take 20 s of Slurm's 30 s KillWait); a damaged middle block is found, and a
    manifest of format 1 (one SHA-256 per file) written before still verifies, damage included."""
    import hashlib

    from megatron_darl.checkpoint import checksums

    monkeypatch.setattr(checksums, "BLOCK_BYTES", 1000)
    ckpt = _fake_checkpoint(tmp_path / "step_000002")
    data = (ckpt / "__0_0.distcp").read_bytes()  # 10240 bytes: 11 blocks, the last one short
    assert write_manifest(ckpt) == ""
    entry = read_manifest(ckpt)["__0_0.distcp"]
    blocks = b"".join(hashlib.sha256(data[i:i + 1000]).digest() for i in range(0, len(data), 1000))
    assert entry == {"bytes": 10240, "sha256": hashlib.sha256(blocks).hexdigest(), "block_bytes": 1000}
    assert verify_checkpoint(ckpt) == ""
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.seek(5500)  # the 6th block
        f.write(b"\x00")
    assert verify_checkpoint(ckpt).startswith(f"{ckpt / '__0_0.distcp'} does not match its checksum")

    old = _fake_checkpoint(tmp_path / "step_000001")
    files = {name: {"bytes": (old / name).stat().st_size, "sha256": hashlib.sha256((old / name).read_bytes()).hexdigest()}
             for name in checksums.checkpoint_files(old)}
    (old / MANIFEST_NAME).write_text(json.dumps({"format_version": 1, "algorithm": "sha256", "files": files}))
    assert verify_checkpoint(old) == ""
    (old / "common.pt").write_bytes(b"commoN")
    assert verify_checkpoint(old).startswith(f"{old / 'common.pt'} does not match its checksum")


def test_nonfinite_parameter_names_the_first():
    import torch

    good, bad = torch.ones(3), torch.tensor([1.0, float("nan"), float("inf"), float("nan")])
    assert nonfinite_parameter([("a", good)]) == ""
    assert nonfinite_parameter([("a", good), ("b", bad)]) == "b (3 of 4 values are nan/inf)"


def test_a_save_over_half_the_stop_grace_is_warned_about_naming_the_graceful_stop():
    """Slurm's KillWait (loop.stop_grace_s) must hold the step in flight and the save: a save over
    half of it is said, with the stop that has no deadline; none without a grace or under half."""
    from megatron_darl.checkpoint.manager import grace_warning

    assert grace_warning("step_000010", 14.9, 30.0) == ""
    assert grace_warning("step_000010", 45.0, None) == ""
    said = grace_warning("step_000010", 21.3, 30.0)
    assert said.startswith("checkpoint step_000010 took 21.3 s; a stop signal leaves 30 s (loop.stop_grace_s")
    assert "scancel --batch --signal=USR1" in said
