"""Where each benchmark's file lives and which dataset preset reads it.

``configs/eval/benchmarks.yaml`` names, per benchmark, the ``configs/data/*.yaml`` preset (column
mapping, prompt template, reward task) and the file path relative to the benchmark directory.
A path can be overridden per benchmark (``tools/eval.py --<name>-path``); a missing file is an
error that names the file, ``tools/prepare_data.py`` (which fetches it) and the flag that sets it.
``check_benchmarks`` is the launcher's check of ``eval.benchmarks``: names and files only, so it
lives here, away from the harness (which imports math-verify and torch).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from megatron_darl.data.config import DataConfig, load_data_config
from megatron_darl.data.locations import benchmark_home
from megatron_darl.eval.config import BenchmarkConfig, PeriodicEvalConfig

HELDOUT = "heldout"  # the run's own generated task, held out (``eval/periodic.py``)
REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "configs" / "eval" / "benchmarks.yaml"


def load_benchmark_table(path: str | Path) -> dict[str, BenchmarkConfig]:
    """``configs/eval/benchmarks.yaml`` as ``{name: BenchmarkConfig}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark table {path} does not exist")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    table = {}
    for name, entry in (raw or {}).get("benchmarks", {}).items():
        if not isinstance(entry, dict) or set(entry) != {"data", "path"}:
            raise ValueError(f"{path}: benchmarks.{name} needs exactly the fields 'data' and 'path'")
        table[name] = BenchmarkConfig(**entry)
    return table


def path_flag(name: str) -> str:
    """The tools/eval.py flag that overrides a benchmark's file."""
    return f"--{name}-path"


def resolve_benchmark(
    name: str, bench: BenchmarkConfig, data_dir: Path, benchmark_dir: Path, override: str = ""
) -> DataConfig:
    """The ``DataConfig`` that reads benchmark ``name`` from its file.

    Raises:
        FileNotFoundError: the file is missing; the message names it and the flag to set.
    """
    file = Path(override) if override else Path(bench.path)
    if not file.is_absolute() and not override:
        file = benchmark_dir / file
    if not file.is_file():
        raise FileNotFoundError(
            f"benchmark {name}: file {file} not found; fetch it with python tools/prepare_data.py {name} "
            f"(offline: --from DIR), or set {path_flag(name)} (or --benchmark-dir to a directory holding "
            f"{bench.path})"
        )
    preset = data_dir / f"{bench.data}.yaml"
    return load_data_config(preset, {"name": name, "path": str(file)})


def known_benchmarks(table: Path = TABLE) -> list[str]:
    """Every name ``eval.benchmarks`` accepts."""
    return [HELDOUT, *load_benchmark_table(table)]


def check_benchmarks(cfg: PeriodicEvalConfig, table: Path = TABLE) -> None:
    """Every name is known and its file is there (``ValueError`` / ``FileNotFoundError`` naming the key)."""
    known = known_benchmarks(table)
    for name in cfg.benchmarks:
        if name not in known:
            raise ValueError(f"eval.benchmarks: {name!r} is not a benchmark; known: {', '.join(known)} "
                             f"(configs/eval/benchmarks.yaml)")
        if name != HELDOUT:
            try:
                benchmark_data(name, table)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"eval.benchmarks: {err}") from None


def benchmark_data(name: str, table: Path = TABLE) -> DataConfig:
    """The ``DataConfig`` of a benchmark of the table, its file resolved under ``benchmark_home()``."""
    bench = load_benchmark_table(table)[name]
    return resolve_benchmark(name, bench, REPO / "configs" / "data", benchmark_home())
