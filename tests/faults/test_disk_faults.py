"""A full disk under a checkpoint: refused before the write, or reported after it, never silent.

The disk is real: a tmpfs of a measured size, mounted for the test (root only; skipped
elsewhere), under real checkpoints of a real Megatron ``PolicyTrainer`` in two gloo processes
(DP 2), and under the whole main job. The failures are real too: a checkpoint larger than the
free space, and one whose write runs out of space because another writer filled the disk after
the check (what twelve runs sharing one device disk did to the variant study). Then a disk that
holds about ``keep_checkpoints`` checkpoints (retention must make room before a save, never
deleting the newest), and a disk full for a few steps under the metrics and TensorBoard writers
(they must neither raise nor lose a record).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "procs"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

REPO = Path(__file__).resolve().parents[2]


def _mount(path: Path, size_bytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                   check=True, capture_output=True, timeout=30)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path):
    """A directory where a tmpfs can be mounted; the test is skipped where mounting is not allowed."""
    probe = tmp_path / "probe"
    try:
        _mount(probe, 1 << 16)
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
    _umount(probe)
    mount = tmp_path / "small"
    yield mount
    _umount(mount)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _attempt(fn) -> str | None:
    from megatron_darl.checkpoint.disk import CheckpointFailed

    try:
        fn()
    except CheckpointFailed as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _fill_after_check(small: Path, rank: int):
    """``disk.check_room`` as is, then another writer takes all but 8 KiB of ``small``."""
    import torch.distributed as dist

    from megatron_darl.checkpoint import disk

    real = disk.check_room

    def check_then_fill(*args, **kwargs):
        need = real(*args, **kwargs)
        if rank == 0:
            with open(small / "other_writer.bin", "wb") as f:
                f.write(b"\0" * max(0, shutil.disk_usage(small).free - 8192))
        dist.barrier()
        return need
    return real, check_then_fill


def _saves_on_a_small_disk(rank: int, world: int, roomy: str, small: str, out: str) -> None:
    """Gloo worker: measure a checkpoint, mount a disk for 1.5 of them, then fail both ways."""
    import torch.distributed as dist
    import trainer_procs

    from megatron_darl.checkpoint import disk
    from megatron_darl.checkpoint.training import load_checkpoint, save_checkpoint
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp=1, pp=1, timeout_s=120))
    trainer = trainer_procs._production_trainer(ps, "")
    batch = trainer_procs.make_batch(list(range(ps.dp_rank, len(trainer_procs.SEQ_LENS), ps.dp_size)))
    roomy, small = Path(roomy), Path(small)
    trainer.train_step(batch, trainer_procs.toy_loss)
    save_checkpoint(trainer, roomy / "measure", extra_state={"step": 1})
    size = _du(roomy / "measure")
    if rank == 0:
        _mount(small, int(size * 1.5))
    dist.barrier()
    save_checkpoint(trainer, small / "step_000001", extra_state={"step": 1})
    trainer.train_step(batch, trainer_procs.toy_loss)
    result = {"size": size, "estimate": world * disk.checkpoint_bytes(trainer, 0),
              "refused": _attempt(lambda: save_checkpoint(trainer, small / "step_000002", extra_state={"step": 2}))}
    result["after_refusal"] = sorted(p.name for p in small.iterdir())
    result["first_step"] = load_checkpoint(trainer, small / "step_000001").extra_states[ps.dp_rank]["step"]
    trainer.train_step(batch, trainer_procs.toy_loss)
    if rank == 0:
        shutil.rmtree(small / "step_000001")  # room for one: the next write passes the check
    dist.barrier()
    real, disk.check_room = _fill_after_check(small, rank)
    result["write_failed"] = _attempt(lambda: save_checkpoint(trainer, small / "step_000003", extra_state={"step": 3}))
    disk.check_room = real
    result["after_failure"] = sorted(p.name for p in small.iterdir())
    if rank == 0:
        (small / "other_writer.bin").unlink()
    dist.barrier()  # the ranks are still in step: the same save now succeeds and loads
    save_checkpoint(trainer, small / "step_000003", extra_state={"step": 3})
    result["third_step"] = load_checkpoint(trainer, small / "step_000003").extra_states[ps.dp_rank]["step"]
    Path(f"{out}.{rank}").write_text(json.dumps(result))


@pytest.mark.fault(kind="disk", name="checkpoint larger than the free space; disk filled by another writer mid-save")
def test_a_checkpoint_the_disk_cannot_hold_is_refused_or_reported_on_every_rank(small_disk, tmp_path, fault_record):
    """Both ranks raise the same error naming the checkpoint, the filesystem and the free space; no partial write stays; the earlier checkpoint loads and the ranks go on."""
    from megatron_darl.trainer.parallel import run_local_gloo

    out = tmp_path / "result"
    run_local_gloo(_saves_on_a_small_disk, 2, args=(str(tmp_path / "roomy"), str(small_disk), str(out)),
                   timeout_s=400)
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    first = results[0]
    # the estimate is of the tensor payload: under the bytes on disk, by their files' overhead only
    assert 0.8 * first["size"] < first["estimate"] <= first["size"], first
    for r in results:
        assert r["refused"] == first["refused"]  # agreed: the same numbers on every rank
        assert r["write_failed"].split(" (")[0] == first["write_failed"].split(" (")[0]  # each its own cause
        assert "the disk is the likely cause" in r["write_failed"] and "KiB free" in r["write_failed"]
        assert (r["first_step"], r["third_step"]) == (1, 3)
    refused = first["refused"]
    assert refused.startswith(f"NoRoomForCheckpoint: checkpoint {small_disk / 'step_000002'} not written: "
                              f"it needs about ") and f"the filesystem of {small_disk} has " in refused
    assert "Nothing was written; earlier checkpoints are untouched" in refused and "loop.keep_checkpoints" in refused
    assert first["after_refusal"] == ["step_000001"]
    failed = first["write_failed"]
    assert failed.startswith(f"CheckpointFailed: checkpoint {small_disk / 'step_000003'} not written (")
    assert "the disk is the likely cause" in failed and "The partial write is removed" in failed
    assert first["after_failure"] == ["other_writer.bin"]  # no step_000003.tmp left behind
    fault_record["observed"] = (f"a {first['size'] / 1e6:.1f} MB checkpoint (estimated "
                                f"{first['estimate'] / 1e6:.1f} MB) on a tmpfs of 1.5 of it: the second "
                                "was refused before writing; after another writer filled the disk, the "
                                "write failed on both ranks with the disk named and its .tmp removed; "
                                "the same save then succeeded")
    fault_record["lost"] = "nothing: the earlier checkpoint loads, the refused ones were never begun"


@pytest.mark.fault(kind="disk", name="main job whose checkpoints do not fit")
def test_the_main_job_trains_on_when_a_checkpoint_between_steps_does_not_fit(small_disk, tmp_path, fault_record):
    """Checkpoints between steps that do not fit are logged and training goes on; the final one that does not fit ends the run non-zero in one line naming the filesystem, the bytes and the newest checkpoint (none)."""
    from test_loop_smoke import run_smoke

    _mount(small_disk, 3 << 20)  # metrics and logs fit, no tiny-model checkpoint does (~9.5 MB)
    proc = run_smoke(small_disk / "run", "algorithm=sync", "loop.checkpoint_interval=1", steps=3)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    refused = [line for line in text.splitlines() if "not written: it needs about" in line]
    assert any("step_000001 not written" in line and "training goes on" in line for line in refused), text[-3000:]
    assert any("step_000003 not written" in line for line in refused), text[-3000:]
    last = [line for line in text.splitlines() if "run failed" in line]  # the launcher's verdict names the disk
    assert last and "step_000003 not written: it needs about" in last[-1], text[-3000:]
    assert f"no checkpoint was written in {small_disk / 'run' / 'checkpoints'}" in last[-1], last[-1]
    assert "Traceback" not in text, text[-3000:]
    rows = [json.loads(x) for x in (small_disk / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # every step trained despite the refusals
    assert not list((small_disk / "run" / "checkpoints").glob("step_*"))  # nor any partial one
    fault_record["observed"] = "steps 0-2 trained; the checkpoints at steps 1 and 2 were refused with a logged " \
                               "error, the final one ended the run non-zero naming the filesystem and the free space"
    fault_record["lost"] = "the final state (no room for it); no step was lost to the refusals between steps"



def _fill(small: Path) -> Path:
    """Another writer takes every free byte of ``small``; returns its file."""
    filler = small / "other_writer.bin"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
    return filler


@pytest.mark.fault(kind="disk", name="disk full for a few steps under the metrics and TensorBoard writers")
def test_the_metrics_writers_outlive_a_full_disk_and_catch_up(small_disk, caplog, fault_record):
    """Records of steps logged while the disk is full wait in memory (one warning per writer), and are in metrics.jsonl (whole lines, in order) and TensorBoard once there is room again."""
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_darl.loop.config import LoopConfig
    from megatron_darl.loop.metrics import MetricsLogger, read_metrics

    _mount(small_disk, 4 << 20)
    run = small_disk / "run"
    logger = MetricsLogger(LoopConfig(steps=16, run_dir=str(run), progress_bar=False, plot=False))
    caplog.set_level(logging.INFO, logger="megatron_darl.loop.metric_writers")
    record = lambda step: {"loss": float(step), "samples_received": 1.0, "staleness_hist": [0.5] * 64}  # noqa: E731
    for step in range(2):
        logger.log(step, record(step))
    filler = _fill(small_disk)
    for step in range(2, 12):  # ~1 KB of jsonl, ~4 KB of events each: past the last page's slack
        logger.log(step, record(step))  # the old writers raised here: the trainer died through TensorBoard
    full = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    filler.unlink()
    for step in range(12, 16):
        logger.log(step, record(step))
    logger.close()
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(16)) and [r["loss"] for r in rows] == [float(s) for s in range(16)]
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert sorted({e.step for e in events.Scalars("loss")}) == list(range(16))
    assert len(full) == 2 and all("No space left on device" in m and "wait in memory" in m for m in full), full
    assert any(str(run / "metrics.jsonl") in m for m in full) and any(str(run / "tensorboard") in m for m in full)
    caught_up = [r.getMessage() for r in caplog.records if "written again" in r.getMessage()]
    assert len(caught_up) == 2, caught_up
    fault_record["observed"] = ("steps 2-11 logged on a full 4 MiB tmpfs: one warning per writer, no exception; "
                                "once the filler was removed, metrics.jsonl and TensorBoard held steps 0-15")
    fault_record["lost"] = "nothing"


def _retention_on_a_small_disk(rank: int, world: int, roomy: str, small: str, out: str) -> None:
    """One gloo rank: measure a checkpoint, mount a disk for 2.5 of them, save through the run's
    checkpoint policy (keep 2), then fill the disk and save again."""
    import trainer_procs

    from megatron_darl.checkpoint.manager import CheckpointManager
    from megatron_darl.loop.config import LoopConfig
    from megatron_darl.checkpoint.training import save_checkpoint
    from megatron_darl.trainer.config import ParallelConfig
    from megatron_darl.trainer.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp=1, pp=1, timeout_s=120))
    trainer = trainer_procs._production_trainer(ps, "")
    batch = trainer_procs.make_batch()
    trainer.train_step(batch, trainer_procs.toy_loss)  # a never-stepped optimizer has no state to save
    save_checkpoint(trainer, Path(roomy) / "measure", extra_state={"step": 0})
    size = _du(Path(roomy) / "measure")
    _mount(Path(small), int(size * 2.5))
    run = Path(small) / "run"
    policy = CheckpointManager(LoopConfig(run_dir=str(run), keep_checkpoints=2), trainer, ps, False,
                            lambda step: {"step": step})
    result = {"size": size, "kept": []}
    for step in (1, 2, 3, 4):  # the old policy refused step 3: its retention ran only after a save
        trainer.train_step(batch, trainer_procs.toy_loss)
        policy.save(step)
        result["kept"].append(sorted(p.name for p in (run / "checkpoints").iterdir()))
    _fill(Path(small))
    try:
        policy.save(5)
    except Exception as exc:  # noqa: BLE001 - the test reports what it was
        result["refused"] = f"{type(exc).__name__}: {exc}"
    result["after"] = sorted(p.name for p in (run / "checkpoints").iterdir())
    Path(out).write_text(json.dumps(result))


@pytest.mark.fault(kind="disk", name="a disk that holds about keep_checkpoints checkpoints; then a full one")
def test_retention_makes_room_before_a_save_and_never_deletes_the_newest(small_disk, tmp_path, fault_record):
    """With keep_checkpoints=2 on a disk of 2.5 checkpoints every save succeeds (the oldest kept one is deleted first); on a full disk the save is refused in one line naming the filesystem, the bytes needed and the newest checkpoint, and nothing is deleted."""
    from megatron_darl.trainer.parallel import run_local_gloo

    out = tmp_path / "result.json"
    run_local_gloo(_retention_on_a_small_disk, 1, args=(str(tmp_path / "roomy"), str(small_disk), str(out)),
                   timeout_s=300)
    result = json.loads(out.read_text())
    assert result["kept"] == [["step_000001"], ["step_000001", "step_000002"], ["step_000002", "step_000003"],
                              ["step_000003", "step_000004"]], result
    refused, ckpts = result["refused"], small_disk / "run" / "checkpoints"
    assert refused.startswith(f"NoRoomForCheckpoint: checkpoint {ckpts / 'step_000005'} not written: it needs about "), refused
    assert f"the filesystem of {ckpts} has " in refused and "\n" not in refused, refused
    assert refused.endswith(f"the newest checkpoint is {ckpts / 'step_000004'} (resume from it with loop.resume=true)")
    assert result["after"] == ["step_000003", "step_000004"]  # deleting step 3 would not have made room
    fault_record["observed"] = (f"checkpoints of {result['size'] / 1e6:.1f} MB on a tmpfs of 2.5 of them, keep 2: "
                                "saves 3 and 4 each deleted the oldest kept one first and succeeded; on the "
                                "filled disk save 5 was refused in one line naming the filesystem, the bytes "
                                "and step_000004, with nothing deleted")
    fault_record["lost"] = "nothing while one checkpoint's room could be made; then the steps after the newest"
