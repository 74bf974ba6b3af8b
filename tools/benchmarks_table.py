"""Render docs/benchmarks.md from the JSON records under benchmarks/results.

Each benchmark script writes one record per run (docs/architecture.md); this tool keeps, per
(benchmark, device, configuration), the newest record and prints one markdown table per
benchmark with its configuration columns and its metrics, so the page is always regenerated
from data rather than edited by hand.

    python tools/benchmarks_table.py [--results benchmarks/results] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools.scaling_records, when run as a script


def load_records(results: Path) -> list[dict]:
    """Every record in ``results``; a malformed file is an error naming it."""
    records = []
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        missing = {"benchmark", "device", "date", "commit", "config", "metrics"} - set(record)
        if missing:
            raise ValueError(f"{path}: missing fields {sorted(missing)}")
        record["_file"] = path.name
        records.append(record)
    return records


def newest_per_config(records: list[dict]) -> list[dict]:
    """The newest record for each (benchmark, device, config)."""
    best: dict[str, dict] = {}
    for r in records:
        key = json.dumps([r["benchmark"], r["device"], r["config"]], sort_keys=True)
        if key not in best or r["date"] > best[key]["date"]:
            best[key] = r
    return sorted(best.values(), key=lambda r: (r["benchmark"], r["device"], r["date"]))


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict) and "mean" in value:  # a statistic over seeds
        if value["mean"] is None:
            return f"not reached (0/{value.get('of', '?')})"
        spread = f" ± {value['std']:.3g}" if value.get("std") else ""
        return f"{value['mean']:.4g}{spread} (n={value.get('n')}/{value.get('of')})"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def per_case(records: list[dict]) -> list[dict]:
    """Records whose metrics are one dict per case (e.g. per variant, ``async_speedup``) become
    one row per case, with a ``case`` column; lists inside (per-run details) stay in the JSON."""
    out = []
    for r in records:
        metrics = r["metrics"]
        if metrics and all(isinstance(v, dict) and "mean" not in v for v in metrics.values()):
            for case, inner in metrics.items():
                flat = {k: v for k, v in inner.items() if not isinstance(v, list)}
                out.append({**r, "config": {**r["config"], "case": case}, "metrics": flat})
        else:
            out.append(r)
    return out


LAUNCH = ("launch_to_first_step_seconds", "launch_processes_started_seconds", "launch_trainer_ready_seconds",
          "launch_trainer_compile_seconds", "launch_engine_start_seconds", "launch_first_weights_seconds",
          "launch_first_groups_seconds", "launch_first_step_seconds", "dynamo_compiles_after_first_step")


def loop_summary(rows: list[dict]) -> list[str]:
    """``loop_profile``: samples/s by split (``tools/scaling_records.py``), then the launch
    timeline of the records that carry one (seconds from the launch; first step: the step itself)."""
    from tools import scaling_records

    lines = ["Samples/s by trainer:rollout split (B x G per step over the step's seconds):", "",
             scaling_records.table(scaling_records.rows(scaling_records.with_split(rows))), ""]
    timed = [r for r in rows if "launch_to_first_step_seconds" in r["metrics"]]
    if timed:
        head = ["device", "engine", "variant", "layout", "batch", *(k.removeprefix("launch_").removesuffix("_seconds")
                                                                  for k in LAUNCH), "date", "commit"]
        lines += ["Launch to the first trained step, by phase (seconds since the launch; `first_step`: the "
                  "step itself; `trainer_compile`: the warm-up before the first wait):", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in timed:
            c, m = r["config"], r["metrics"]
            batch = f"{c.get('groups')}x{c.get('group_size')}x{c.get('new_tokens')}"
            cells = [r["device"], str(c.get("engine")), c.get("variant", ""), c.get("layout", ""), batch,
                     *(_cell(m[k]) if k in m else "" for k in LAUNCH), r["date"][:16], str(r["commit"])[:8]]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Every metric of each record:", ""]
    return lines


SUMMARIES = {"loop_profile": loop_summary}  # benchmark -> the readable table(s) above its full one


def render(records: list[dict], docs: Path | None = None) -> str:
    """The markdown page; a picture ``docs/img/<benchmark>.png`` (drawn by a tool) goes under its heading."""
    lines = ["# Benchmarks", "",
             "Generated by `python tools/benchmarks_table.py` from `benchmarks/results/*.json`;",
             "the newest run per benchmark, device and configuration. Each record names its",
             "commit; metric names are those of the issues that asked for them.", ""]
    records = per_case(records)
    for name in sorted({r["benchmark"] for r in records}):
        rows = [r for r in records if r["benchmark"] == name]
        cfg_keys = sorted({k for r in rows for k in r["config"]})
        met_keys = sorted({k for r in rows for k in r["metrics"]})
        head = ["device", *cfg_keys, *met_keys, "date", "commit"]
        lines += [f"## {name}", ""]
        if docs is not None and (docs / "img" / f"{name}.png").exists():
            lines += [f"![{name}](img/{name}.png)", ""]
        lines += SUMMARIES.get(name, lambda rs: [])(rows)
        lines += ["| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        for r in rows:
            cells = [r["device"], *(_cell(r["config"].get(k, "")) for k in cfg_keys),
                     *(_cell(r["metrics"].get(k, "")) for k in met_keys),
                     r["date"][:16], str(r["commit"])[:8]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    args = parser.parse_args(argv)
    try:
        page = render(newest_per_config(load_records(Path(args.results))), Path(args.out).parent)
    except ValueError as err:
        print(f"benchmarks_table: {err}", file=sys.stderr)
        return 1
    Path(args.out).write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
