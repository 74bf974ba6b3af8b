"""Where the device waits for the host: the idle gaps between a profiled pass's device kernels and
what the host was running while each gap lasted.

An operator table adds up device time per kernel; it cannot show a step that is host-bound, where
the GPU idles between kernels while Python walks the model. This reads the profiler's Chrome trace
(``prof.export_chrome_trace``): the device's kernels, copies and memsets merged into busy
intervals, the gaps between them inside the pass, and for each gap the host operators
(``cpu_op`` events) that enclose its midpoint. Gap time is then summed by the innermost enclosing
operator and by the outermost one, so a fixed cost per module call or per launch shows as a row.

    python benchmarks/profile_gaps.py TRACE.json        # the table, from a saved trace
"""

from __future__ import annotations

import bisect
import json
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The device's busy time as sorted, disjoint (start, end) intervals in microseconds."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def idle_gaps(trace: dict, min_gap_us: float = 20.0) -> dict:
    """The pass's device idle time and where the host was: ``busy_s``, ``idle_s`` (inside the
    span from the first kernel's start to the last one's end), ``gaps`` (count of gaps of at least
    ``min_gap_us``), ``by_inner`` and ``by_outer``: {host operator: idle seconds} of the gaps whose
    midpoint it encloses (innermost, outermost; "(none)" when no operator does)."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    busy = busy_intervals(events)
    if not busy:
        return {"busy_s": 0.0, "idle_s": 0.0, "gaps": 0, "by_inner": {}, "by_outer": {}}
    host = sorted((e["ts"], e["ts"] + e.get("dur", 0.0), e.get("name", "?")) for e in events
                  if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    starts = [h[0] for h in host]
    by_inner: dict[str, float] = defaultdict(float)
    by_outer: dict[str, float] = defaultdict(float)
    idle = 0.0
    gaps = 0
    for (_, prev_end), (next_start, _) in zip(busy, busy[1:]):
        gap = next_start - prev_end
        idle += gap
        if gap < min_gap_us:
            continue
        gaps += 1
        mid = (prev_end + next_start) / 2
        enclosing = [h for h in host[:bisect.bisect_right(starts, mid)] if h[1] >= mid]
        inner = min(enclosing, key=lambda h: h[1] - h[0])[2] if enclosing else "(none)"
        outer = max(enclosing, key=lambda h: h[1] - h[0])[2] if enclosing else "(none)"
        by_inner[inner] += gap / 1e6
        by_outer[outer] += gap / 1e6
    busy_s = sum(e - s for s, e in busy) / 1e6
    return {"busy_s": busy_s, "idle_s": idle / 1e6, "gaps": gaps,
            "by_inner": dict(by_inner), "by_outer": dict(by_outer)}


def gaps_table(summary: dict, rows: int = 15) -> str:
    """``idle_gaps``'s result as text: the totals, then the two breakdowns, most idle time first."""
    lines = [f"device idle gaps: busy {summary['busy_s']:.4f} s, idle {summary['idle_s']:.4f} s between kernels, "
             f"{summary['gaps']} gaps >= 20 us"]
    for key, title in (("by_inner", "innermost host operator"), ("by_outer", "outermost host operator")):
        lines.append(f"  idle s by {title}:")
        for name, seconds in sorted(summary[key].items(), key=lambda kv: -kv[1])[:rows]:
            lines.append(f"    {seconds:9.4f}  {name[:90]}")
    return "\n".join(lines)


def trace_gaps(prof, path: Path) -> str:
    """Export ``prof``'s Chrome trace to ``path`` and return its gap table."""
    prof.export_chrome_trace(str(path))
    return gaps_table(idle_gaps(json.loads(Path(path).read_text())))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.strip().splitlines()[-1])
    print(gaps_table(idle_gaps(json.loads(Path(sys.argv[1]).read_text()))))
