"""``benchmarks/loop_profile.py`` records what ran and keeps what it measured.

The record is assembled from a run dir alone (its ``run_config.yaml``, ``metrics.jsonl`` and
``launch_timeline.json``), so these tests build fake run dirs instead of running ``launch.train``;
the bookkeeping (a record per finished run, a failed run reported without losing the others) is
driven by a stub in place of the subprocess.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import loop_profile  # noqa: E402
from benchmarks.loop_profile import Plan, RunFailed, build_record, read_run, run_plan  # noqa: E402


def _row(step: int, step_seconds: float, **extra) -> dict:
    return {"step": step, "step_seconds": step_seconds, "samples_received": 256, "samples_selected": 128,
            "train_seconds": step_seconds / 2, "generation_seconds_w0": 3.0, **extra}


def fake_run(run_dir: Path, step_seconds=(9.0, 2.0, 4.0), engine: str | None = "vllm",
             timeline: dict | None = None, compiles: list | None = None) -> Path:
    """A run dir as launch.train leaves it (``engine`` None: no run_config.yaml, an older run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if engine is not None:
        cfg = {"engine": {"backend": engine, "dtype": "bf16"}, "worker": {"update_mode": "interrupt"},
               "algorithm": {"groups_per_step": 33, "group_size": 8}, "sampling": {"max_new_tokens": 1024}}
        (run_dir / "run_config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [_row(i, s, **({"dynamo_compiles": compiles[i]} if compiles else {}))
            for i, s in enumerate(step_seconds)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if timeline is not None:
        (run_dir / "launch_timeline.json").write_text(json.dumps({"t0": 1.7e9, "phases": timeline}))
    (run_dir / "checkpoints" / "step_000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000003" / "weights.bin").write_bytes(b"0" * 64)
    return run_dir


BASE = {"model": "qwen3_1.7b", "groups": 32, "group_size": 8, "new_tokens": 1024, "steps": 3,
        "overrides": ["rollout@_global_=vllm"]}


def test_the_record_names_the_engine_and_update_mode_the_run_resolved(tmp_path):
    run = read_run(fake_run(tmp_path / "r", timeline={
        "launch_to_first_step_seconds": 41.5, "spawn_seconds": 2.0, "launch_engine_seconds": 30.0},
        compiles=[12, 15, 15]), wall_seconds=77.0)
    config, metrics = build_record([run], skip=1, base={**BASE, "layout": "t3r1", "variant": "darl"})
    assert config["engine"] == "vllm" and config["update_mode"] == "interrupt"
    # 32 asked for; the run (3 DP ranks) ran 33: the record says both
    assert (config["groups"], config["groups_requested"], config["new_tokens"]) == (33, 32, 1024)
    assert metrics["step_seconds"] == pytest.approx(3.0)  # steps 1 and 2; step 0's 9 s left out
    assert metrics["samples_per_s"] == pytest.approx(256 / 3.0)
    assert metrics["first_step_seconds"] == 9.0 and metrics["launch_seconds"] == 77.0
    assert metrics["launch_to_first_step_seconds"] == 41.5
    assert metrics["launch_spawn_seconds"] == 2.0 and metrics["launch_engine_seconds"] == 30.0
    assert "spawn_seconds" not in metrics and "launch_launch_engine_seconds" not in metrics
    assert metrics["dynamo_compiles_after_first_step"] == 3


def test_an_older_run_dir_without_timeline_counter_or_config_still_makes_a_record(tmp_path):
    run = read_run(fake_run(tmp_path / "r", engine=None), wall_seconds=10.0)
    config, metrics = build_record([run], skip=1, base={**BASE, "layout": "gpu2", "variant": "darl"})
    assert config["engine"] is None and config["update_mode"] is None  # unknown, not guessed
    assert config["groups"] == 32 and "groups_requested" not in config
    assert not any(k.startswith("launch_") and k != "launch_seconds" for k in metrics)
    assert "dynamo_compiles_after_first_step" not in metrics


def test_one_slow_step_moves_the_mean_and_the_record_keeps_the_median_and_the_worst(tmp_path):
    run = read_run(fake_run(tmp_path / "a", (9.0, 2.0, 2.0, 8.0)), wall_seconds=60.0)
    _, metrics = build_record([run], skip=1, base=BASE)
    assert metrics["step_seconds"] == pytest.approx(4.0)
    assert (metrics["step_seconds_median"], metrics["step_seconds_max"]) == (2.0, 8.0)


def fake_nvidia_smi(folder: Path, memory: str, apps: str) -> None:
    """An ``nvidia-smi`` that answers the two queries ``record.gpus_in_use`` asks (no GPU here)."""
    folder.mkdir()
    tool = folder / "nvidia-smi"
    tool.write_text(f"""#!/bin/sh\ncase "$1" in --query-gpu=*) printf '{memory}' ;; *) printf '{apps}' ;; esac\n""")
    tool.chmod(0o755)


def test_what_holds_the_gpus_at_a_runs_start_goes_into_its_record_the_worst_of_the_runs(tmp_path, monkeypatch):
    from benchmarks.record import gpus_in_use

    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpus_in_use() is None  # no nvidia-smi: nothing to say
    # two other processes, and this one (a benchmark that built its policy on the GPU: 600 MiB)
    fake_nvidia_smi(tmp_path / "bin", "0\n1112\n[N/A]\n1024\n", f"4711, 512\n{os.getpid()}, 600\n4712, 1024\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    busy = gpus_in_use()
    assert busy == {"gpu_processes_at_start": 2.0, "gpu_memory_used_at_start_mib": 1536.0}
    fake_nvidia_smi(tmp_path / "alone", "600\n0\n", f"{os.getpid()}, 600\n")
    monkeypatch.setenv("PATH", str(tmp_path / "alone"))
    assert gpus_in_use() == {"gpu_processes_at_start": 0.0, "gpu_memory_used_at_start_mib": 0.0}
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    clean = read_run(fake_run(tmp_path / "a", (9.0, 2.0)), wall_seconds=60.0)
    dirty_dir = fake_run(tmp_path / "b", (8.0, 6.0))
    (dirty_dir / "gpus_at_start.json").write_text(json.dumps(busy))  # as run_layout leaves it
    dirty = read_run(dirty_dir, wall_seconds=80.0)
    assert clean.gpus_at_start == {} and dirty.gpus_at_start == busy
    _, metrics = build_record([clean, dirty], skip=1, base=BASE)
    assert metrics["gpu_processes_at_start"] == 2.0 and metrics["gpu_memory_used_at_start_mib"] == 1536.0


def test_repeats_pool_steady_steps_and_average_the_launch_phases(tmp_path):
    first = read_run(fake_run(tmp_path / "a", (9.0, 2.0), timeline={"launch_to_first_step_seconds": 40.0},
                              compiles=[10, 14]), wall_seconds=60.0)
    second = read_run(fake_run(tmp_path / "b", (8.0, 6.0), timeline={"launch_to_first_step_seconds": 50.0}),
                      wall_seconds=80.0)
    _, metrics = build_record([first, second], skip=1, base=BASE)
    assert metrics["runs"] == 2 and metrics["step_seconds"] == pytest.approx(4.0)  # 2 and 6
    assert metrics["launch_seconds"] == 70.0 and metrics["launch_to_first_step_seconds"] == 45.0
    assert metrics["dynamo_compiles_after_first_step"] == 4  # only the first run counted


def test_batch_defaults_are_the_realistic_shape_and_quick_is_the_small_one():
    a = loop_profile.parse_args(["--splits", "3:1,1:3"])
    assert (a.groups, a.group_size, a.new_tokens) == (32, 8, 1024)
    assert loop_profile.default_layouts(a) == ["t3r1", "t1r3"]
    q = loop_profile.parse_args(["--quick", "--new-tokens", "64"])
    assert (q.groups, q.group_size, q.new_tokens) == (8, 8, 64)
    cmd = loop_profile.launch_command("t3r1", "darl", Path("/p"), a, Path("/run"))
    assert "algorithm.groups_per_step=32" in cmd and "worker.groups_per_batch=32" in cmd  # one worker, DP 3
    spread = loop_profile.launch_command("t1r3", "darl", Path("/p"), a, Path("/run"))
    assert "worker.groups_per_batch=11" in spread  # three workers: a third of the step's groups each
    assert "loop.keep_checkpoints=1" in cmd and "sampling.max_new_tokens=1024" in cmd
    with pytest.raises(SystemExit):
        loop_profile.parse_args(["--groups", "0"])


def test_a_failed_layout_keeps_the_records_before_it_and_the_runs_after_it_go_on(tmp_path):
    out = tmp_path / "results"
    plan = Plan(layouts=["t1r1", "t2r2", "t3r1"], variants=["darl", "decoupled"], base=BASE,
                work_dir=tmp_path / "work", out_dir=out)
    seen: list[tuple[str, str, int]] = []

    def run(layout: str, variant: str, run_dir: Path) -> float:
        seen.append((layout, variant, len(list(out.glob("*.json"))) if out.exists() else 0))
        if (layout, variant) == ("t2r2", "darl"):  # its final checkpoint hit a full disk
            fake_run(run_dir)
            raise RunFailed("t2r2 darl failed (exit 1):\nOSError: [Errno 28] No space left on device")
        fake_run(run_dir, (9.0, 2.0) if variant == "darl" else (9.0, 1.0))
        return 5.0

    written, failures = run_plan(plan, run)
    assert [s[:2] for s in seen] == [(lay, v) for lay in plan.layouts for v in plan.variants]
    assert seen[2] == ("t2r2", "darl", 2)  # t1r1's two records were on disk before t2r2 started
    assert len(failures) == 1 and failures[0].startswith("t2r2 darl (run 1 of 1)")
    assert "No space left on device" in failures[0]
    assert set(written) == {("t1r1", "darl"), ("t1r1", "decoupled"), ("t2r2", "decoupled"),
                            ("t3r1", "darl"), ("t3r1", "decoupled")}
    records = [json.loads(p.read_text()) for p in sorted(out.glob("loop_profile_*.json"))]
    assert len(records) == 5
    by = {(r["config"]["layout"], r["config"]["variant"]): r for r in records}
    # darl's record, written before decoupled's, was rewritten with the comparison: 2 s over 1 s
    assert by[("t1r1", "darl")]["metrics"]["step_to_decoupled"] == pytest.approx(2.0)
    assert by[("t1r1", "decoupled")]["metrics"]["step_to_decoupled"] == pytest.approx(1.0)
    assert by[("t3r1", "darl")]["config"]["trainer_gpus"] == 3
    assert by[("t1r1", "darl")]["config"]["engine"] == "vllm"
    assert not list((tmp_path / "work").glob("*/checkpoints"))  # freed after each run, failed one included


def test_main_exits_non_zero_naming_the_failed_run(tmp_path, monkeypatch, capsys):
    def run_layout(layout, variant, policy, a, run_dir):
        if layout == "t1r1":
            fake_run(run_dir)
            return 3.0
        raise RunFailed(f"{layout} {variant}: no exit within --timeout 5 s:\nlast line of its log")

    monkeypatch.setattr(loop_profile, "run_layout", run_layout)
    monkeypatch.setattr(loop_profile, "build_policy", lambda model, out: out)
    code = loop_profile.main(["--splits", "1:1,1:3", "--work-dir", str(tmp_path / "w"),
                              "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1 and "FAILED t1r3 darl (run 1 of 1)" in err and "last line of its log" in err
    assert len(list((tmp_path / "o").glob("loop_profile_*.json"))) == 1


def test_a_run_that_exits_cleanly_without_metrics_is_a_failure_not_a_crash(tmp_path):
    plan = Plan(layouts=["t1r1"], variants=["darl", "decoupled"], base=BASE, work_dir=tmp_path / "w",
                out_dir=tmp_path / "o", repeats=2)
    calls: list[str] = []

    def run(layout: str, variant: str, run_dir: Path) -> float:
        calls.append(variant)
        if variant == "darl":
            fake_run(run_dir)
        else:
            run_dir.mkdir(parents=True, exist_ok=True)  # exit 0, yet no step was logged
        return 1.0

    written, failures = run_plan(plan, run)
    assert calls == ["darl", "decoupled", "darl"]  # decoupled's second repeat is not tried
    assert list(written) == [("t1r1", "darl")] and written[("t1r1", "darl")][2]["runs"] == 2
    assert len(failures) == 1 and "decoupled (run 1 of 2)" in failures[0] and "metrics.jsonl: missing" in failures[0]
