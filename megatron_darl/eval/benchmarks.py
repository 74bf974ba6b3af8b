"""Where each benchmark's file lives and which dataset preset reads it.

``configs/eval/benchmarks.yaml`` names, per benchmark, the ``configs/data/*.yaml`` preset (column
mapping, prompt template, reward task) and the file path relative to the benchmark directory.
A path can be overridden per benchmark (``tools/eval.py --<name>-path``); a missing file is an
error that names the file, ``tools/prepare_data.py`` (which fetches it) and the flag that sets it.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from megatron_darl.data.config import DataConfig, load_data_config
from megatron_darl.eval.config import BenchmarkConfig


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
