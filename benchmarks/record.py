"""One JSON record per benchmark run, in the schema of docs/architecture.md (Records, reports and tests).

Every script in ``benchmarks/`` prints its own table and calls ``write_result`` once per run so
that ``tools/benchmarks_table.py`` can render docs/benchmarks.md from ``benchmarks/results/``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    """``nvidia-smi`` name of GPU 0 (as torch reports it), or ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def git_commit() -> str:
    """Commit of the checkout the benchmark ran from.

    A copy without ``.git`` (the GPU machine gets the working tree only) names it through the
    ``DARL_COMMIT`` environment variable; otherwise ``unknown``.
    """
    if os.environ.get("DARL_COMMIT"):
        return os.environ["DARL_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=RESULTS_DIR.parent, capture_output=True,
            text=True, timeout=10, check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_result(
    benchmark: str, config: dict[str, Any], metrics: dict[str, Any], out_dir: Path | None = None,
    device: str | None = None,
) -> Path:
    """Write ``{"benchmark", "device", "date", "commit", "config", "metrics"}`` and return its path.

    ``device`` names the machine the measurements ran on when that is not this one (a record
    written afterwards from runs saved on the GPU machine)."""
    now = _dt.datetime.now(_dt.timezone.utc)
    record = {
        "benchmark": benchmark,
        "device": device or device_name(),
        "date": now.isoformat(timespec="seconds"),
        "commit": git_commit(),
        "config": config,
        "metrics": metrics,
    }
    directory = Path(out_dir) if out_dir is not None else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    tag = record["device"].replace(" ", "_").replace("/", "_")
    stem = f"{benchmark}_{tag}_{now.strftime('%Y%m%dT%H%M%S')}"
    path = directory / f"{stem}.json"
    for n in range(2, 1000):  # several records in one second (a script writing one per case)
        if not path.exists():
            break
        path = directory / f"{stem}_{n}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print rows of equal keys as an aligned text table."""
    if not rows:
        return
    keys = list(rows[0])
    cells = [[_fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
