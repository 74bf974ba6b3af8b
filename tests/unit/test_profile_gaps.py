"""benchmarks/profile_gaps.py: the device's idle gaps in a Chrome trace, and the host operator
that held each one."""

import json

import pytest

from benchmarks.profile_gaps import busy_intervals, gaps_table, idle_gaps


def kernel(ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}


def op(name, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur}


def test_overlapping_kernels_merge_and_instants_are_ignored():
    events = [kernel(0, 10), kernel(5, 10), kernel(30, 5, "gpu_memcpy"), {"ph": "i", "cat": "kernel", "ts": 20},
              op("aten::mm", 0, 100)]
    assert busy_intervals(events) == [(0, 15), (30, 35)]


def test_gap_time_goes_to_the_innermost_and_outermost_enclosing_operator():
    events = [
        op("forward", 0, 1000),            # encloses everything
        op("Linear", 100, 300),            # encloses the first gap's midpoint (250)
        op("aten::addmm", 240, 20),        # innermost there
        kernel(0, 200), kernel(300, 100),  # gap 200-300: 100 us
        kernel(900, 50),                   # gap 400-900: 500 us, midpoint 650 inside forward only
        kernel(960, 10),                   # gap 950-960: 10 us, under the threshold
        kernel(2000, 10),                  # gap 970-2000: no operator encloses 1485
    ]
    got = idle_gaps({"traceEvents": events})
    assert got["busy_s"] == pytest.approx((200 + 100 + 50 + 10 + 10) / 1e6)
    assert got["idle_s"] == pytest.approx((100 + 500 + 10 + 1030) / 1e6)
    assert got["gaps"] == 3
    assert got["by_inner"] == pytest.approx({"aten::addmm": 100e-6, "forward": 500e-6, "(none)": 1030e-6})
    assert got["by_outer"] == pytest.approx({"forward": 600e-6, "(none)": 1030e-6})
    table = gaps_table(got)
    assert table.splitlines()[0].startswith("device idle gaps: busy 0.0004 s, idle 0.0016 s")
    assert table.index("(none)") < table.index("aten::addmm")  # most idle time first


def test_a_trace_without_device_work_has_no_gaps(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps([op("aten::mm", 0, 10)]))  # a bare event list is a trace too
    assert idle_gaps(json.loads(path.read_text())) == {"busy_s": 0.0, "idle_s": 0.0, "gaps": 0,
                                                      "by_inner": {}, "by_outer": {}}
