"""The launch timeline (``megatron_darl/timeline.py``): phases from several processes' files.

Each process of a run writes its own file; these tests write them the way the processes do (one
``start`` per process, in separate subprocesses for the real case) and check the phases.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from megatron_darl import timeline


def write(folder, who, events):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{who}.jsonl").write_text(
        "".join(json.dumps({"who": who, "event": e, "t": t}) + "\n" for e, t in events.items()))


def test_phases_take_the_slowest_worker_and_skip_what_was_not_reached(tmp_path):
    folder = tmp_path / "timeline"
    write(folder, "launch", {"process_start": 100.0, "launch": 100.0})
    write(folder, "trainer0", {"process_start": 103.0, "imports": 110.0, "parallel": 111.0,
                               "model_built": 113.0, "weights_loaded": 120.0, "trainer_ready": 125.0,
                               "warm_up_start": 125.0, "warmed_up": 150.0, "first_groups": 190.0,
                               "first_step": 200.0})
    write(folder, "rollout0", {"process_start": 104.0, "engine_ready": 160.0, "first_weights": 160.0})
    write(folder, "rollout1", {"process_start": 105.0, "engine_ready": 175.0, "first_weights": 175.0})
    t0, p = timeline.phases(timeline.read(tmp_path))
    assert t0 == 100.0
    assert p["processes_started_seconds"] == 5.0  # the last child's start
    assert p["model_load_seconds"] == 9.0 and p["trainer_compile_seconds"] == 25.0
    assert p["engine_start_seconds"] == 70.0  # rollout1: 105 -> 175, the slower of the two
    assert p["engine_ready_seconds"] == 75.0 and p["first_weights_seconds"] == 75.0
    assert p["first_groups_seconds"] == 90.0 and p["first_step_seconds"] == 10.0
    assert p["launch_to_first_step_seconds"] == 100.0
    assert "first_checkpoint_seconds" not in p  # not reached: left out, not zero
    assert "checkpoint_load_seconds" not in p  # a fresh run loads no checkpoint
    assert "checkpoint load" not in timeline.describe(p)
    assert "first trained step done 100.0 s after launch" in timeline.describe(p)


def test_a_resumed_runs_checkpoint_load_is_its_own_phase_not_compile(tmp_path):
    write(tmp_path / "timeline", "launch", {"process_start": 100.0, "launch": 100.0})
    write(tmp_path / "timeline", "trainer0", {"process_start": 103.0, "trainer_ready": 125.0,
                                              "checkpoint_loaded": 187.0, "warm_up_start": 188.0,
                                              "warmed_up": 195.0, "first_step": 260.0})
    _, p = timeline.phases(timeline.read(tmp_path))
    assert p["checkpoint_load_seconds"] == 62.0
    assert p["trainer_compile_seconds"] == 7.0  # the warm-up passes alone, not the load before them
    line = timeline.describe(p)
    assert "checkpoint load 62.0 s" in line and "trainer compile 7.0 s" in line
    assert line.index("trainer ready") < line.index("checkpoint load") < line.index("trainer compile")


def test_without_a_launcher_t0_is_the_first_process_start(tmp_path):
    write(tmp_path / "timeline", "trainer0", {"process_start": 50.0, "first_step": 80.0})
    write(tmp_path / "timeline", "rollout0", {"process_start": 48.0})
    t0, p = timeline.phases(timeline.read(tmp_path))
    assert t0 == 48.0 and p["launch_to_first_step_seconds"] == 32.0


def test_processes_write_their_own_files_and_a_new_launch_clears_the_last(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from megatron_darl import timeline
        timeline.start({str(tmp_path)!r}, sys.argv[1])
        timeline.mark("imports")
        timeline.mark("first_step")
    """)
    write(tmp_path / "timeline", "rollout7", {"process_start": 1.0})  # a worker of the last launch
    timeline.begin(tmp_path)
    assert not (tmp_path / "timeline" / "rollout7.jsonl").exists()
    for who in ("trainer0", "rollout0"):
        subprocess.run([sys.executable, "-c", code, who], check=True, timeout=120)
    events = timeline.read(tmp_path)
    assert set(events) == {"launch", "trainer0", "rollout0"}
    assert events["trainer0"]["process_start"] <= events["trainer0"]["imports"] <= events["trainer0"]["first_step"]
    p = timeline.summarize(tmp_path)
    saved = json.loads((tmp_path / timeline.SUMMARY).read_text())
    assert saved["phases"] == pytest.approx(p) and p["launch_to_first_step_seconds"] > 0


def test_mark_without_start_does_nothing_and_a_cut_line_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "_recorder", None)
    timeline.mark("first_step")  # a tool or a test: no file, no error
    assert not (tmp_path / "timeline").exists()
    write(tmp_path / "timeline", "trainer0", {"process_start": 1.0})
    with (tmp_path / "timeline" / "trainer0.jsonl").open("a") as f:
        f.write('{"who": "trainer0", "ev')  # killed mid-write
    assert timeline.read(tmp_path) == {"trainer0": {"process_start": 1.0}}


def test_what_a_launcher_noted_before_its_timeline_began_is_marked_at_its_own_time(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "_recorder", None)
    monkeypatch.setattr(timeline, "_noted", {})
    monkeypatch.setattr(timeline, "process_start_time", lambda: 1000.0)  # the launcher's start: t0
    clock = iter([1002.5, 1003.5, 1007.0, 1008.0])  # imports done, config composed, inputs checked
    monkeypatch.setattr(timeline.time, "time", lambda: next(clock))
    for event in ("main_start", "config_loaded", "inputs_checked"):
        timeline.note(event)
    timeline.note("config_loaded")  # noted twice: the first time counts, as with mark
    write(tmp_path / "timeline", "launch", {"process_start": 1.0})  # the last launch's file
    timeline.begin(tmp_path)
    monkeypatch.setattr(timeline, "_recorder", None)
    events = timeline.read(tmp_path)["launch"]
    assert events == {"process_start": 1000.0, "launch": 1000.0, "main_start": 1002.5,
                      "config_loaded": 1003.5, "inputs_checked": 1007.0}
    _, p = timeline.phases(timeline.read(tmp_path))
    assert p["launcher_imports_seconds"] == 2.5 and p["launcher_config_seconds"] == 1.0
    assert p["launcher_checks_seconds"] == 3.5
    assert timeline._noted == {}  # marked once: a second launch in this process notes afresh
