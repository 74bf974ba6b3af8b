"""One JSON record per benchmark run, in the schema of docs/architecture.md (Records, reports and tests).

Every script in ``benchmarks/`` prints its own table and calls ``write_result`` once per run so
that ``tools/benchmarks_table.py`` can render docs/benchmarks.md from ``benchmarks/results/``.
A record names what ran as the run resolved it, not as the command line suggested:
``run_config_facts`` reads the engine, its update mode and the batch from a ``launch.train`` run's
own ``run_config.yaml`` (an engine guessed from an ``engine.backend=`` override would record a
``rollout@_global_=vllm`` run as ``hf``). ``amend_result`` adds metrics to a
record already written (a comparison that needs a later run), leaving the rest as it was.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RUN_FACTS = {  # record config field -> its path in a run's run_config.yaml (RunConfig)
    "engine": ("engine", "backend"),
    "update_mode": ("worker", "update_mode"),
    "groups": ("algorithm", "groups_per_step"),
    "group_size": ("algorithm", "group_size"),
    "new_tokens": ("sampling", "max_new_tokens"),
}


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


def gpus_in_use() -> dict[str, float] | None:
    """What holds the GPUs before a run starts: ``gpu_processes_at_start`` (compute processes) and
    ``gpu_memory_used_at_start_mib`` (summed over the GPUs), this process and its memory left out
    (the benchmark that asks may hold a CUDA context of its own). A run that starts beside another
    run's leftovers measures both. None without ``nvidia-smi`` or when it does not answer."""
    def query(*args: str) -> list[str]:
        out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    try:
        memory = query("--query-gpu=memory.used")
        apps = [line.split(",") for line in query("--query-compute-apps=pid,used_memory")]
    except (OSError, subprocess.SubprocessError):
        return None
    mine = [app for app in apps if app[0].strip() == str(os.getpid())]
    own = sum(float(app[1]) for app in mine if len(app) > 1 and _number(app[1]))
    used = sum(float(m) for m in memory if _number(m))  # "[N/A]" on some devices
    return {"gpu_processes_at_start": float(len(apps) - len(mine)),
            "gpu_memory_used_at_start_mib": max(0.0, used - own)}


def _number(text: str) -> bool:
    return text.strip().replace(".", "", 1).isdigit()


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


def amend_result(path: Path, metrics: dict[str, Any]) -> Path:
    """Merge ``metrics`` into the record at ``path`` (written by ``write_result``); the rest stays."""
    record = json.loads(Path(path).read_text())
    record["metrics"].update(metrics)
    Path(path).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return Path(path)


def run_config_facts(run_dir: Path) -> dict[str, Any]:
    """The ``RUN_FACTS`` fields of ``<run_dir>/run_config.yaml`` that it holds; ``{}`` without one.

    A malformed file is a ``ValueError`` naming it."""
    import yaml

    path = Path(run_dir) / "run_config.yaml"
    if not path.is_file():
        return {}
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a mapping at the top, got {type(cfg).__name__}")
    facts = {}
    for name, (section, key) in RUN_FACTS.items():
        value = (cfg.get(section) or {}).get(key)
        if value is not None:
            facts[name] = value
    return facts


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
