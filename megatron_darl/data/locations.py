"""Where the benchmark files are looked for when a config does not name one.

Why: a user's first ``data=gsm8k`` or ``tools/eval.py`` must find the files a fresh checkout
can get. ``tools/prepare_data.py`` writes them to ``data/benchmarks/`` under the repo; that
folder is the default. A shared copy beside the checkout (``../shared/data/benchmarks``) is read
when the repo has none, and ``$DARL_BENCHMARK_DIR`` (read by the presets' ``oc.env``, or passed
here) names any other place. Paths come back absolute (a run resolves them once, whatever its
working directory), except the shared copy reached from the repo root, which is spelled
``../shared/data/benchmarks`` relative to the repo: a run's ``data.path``, which a resume
compares, stays the same from one launch to the next.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
LOCAL_BENCHMARKS = REPO / "data" / "benchmarks"  # tools/prepare_data.py writes here by default
SHARED_BENCHMARKS = REPO.parent / "shared" / "data" / "benchmarks"  # a read-only copy, where one exists
OLD_SPELLING = "../shared/data/benchmarks"  # the presets' default before data/benchmarks (from the repo root)
RESOLVER = "benchmark_home"  # ${benchmark_home:} in configs/data/*.yaml


def benchmark_home(override: str | None = None) -> Path:
    """The benchmark directory: ``override`` (``$DARL_BENCHMARK_DIR``) when given, else the
    prepared ``data/benchmarks`` when it holds anything, else the shared copy when present, else
    ``data/benchmarks`` (where ``tools/prepare_data.py`` will write; a missing file names it)."""
    if override:
        return Path(override).expanduser().resolve()
    if LOCAL_BENCHMARKS.is_dir() and any(LOCAL_BENCHMARKS.iterdir()):
        return LOCAL_BENCHMARKS
    if SHARED_BENCHMARKS.is_dir():
        old = Path(OLD_SPELLING)
        return old if old.resolve() == SHARED_BENCHMARKS.resolve() else SHARED_BENCHMARKS
    return LOCAL_BENCHMARKS


def register_resolver() -> None:
    """Register ``${benchmark_home:}`` for OmegaConf (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda: str(benchmark_home()))
