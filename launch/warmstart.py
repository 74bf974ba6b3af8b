"""The embedded default's initial policy, cached on disk: one fit per setting, shared by every run.

The fit itself is ``launch/warmstart_fit.py`` (why the tiny policy is warm-started, and how).
Here is only the cache, keyed by everything that determines the policy: a launch that finds its
policy there (every launch after the first) asks a file's existence and imports no torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from megatron_darl.models.config import WarmStartConfig


def cache_key(cfg: WarmStartConfig) -> str:
    """Stable hash of everything that determines the fitted policy (the cache dir excluded)."""
    payload = asdict(cfg)
    payload.pop("cache_dir")
    payload.pop("device")
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_fit(cfg: WarmStartConfig, key: str, fit: Callable[[Path], Path], what: str, log=print,
               tag: str = "warmstart") -> Path:
    """``cfg.cache_dir/key``, made by ``fit(tmp_dir)`` first when absent.

    Fitting writes to a temporary sibling directory of this process, renamed into place only on
    success, so an interrupted run never leaves a half-written policy in the cache. Runs started
    at once on one cache (a study's first runs, the ranks of a job) take a file lock per key: one
    fits, the others wait for it and reuse its policy; leftovers of a fit that died are removed
    under the lock.
    """
    root = Path(cfg.cache_dir).expanduser()
    final = root / key
    if (final / "config.json").exists():
        log(f"[{tag}] reusing cached initial policy {final}")
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _key_lock(root / f".{key}.lock", lambda: log(f"[{tag}] waiting for another run fitting {final}")):
        if (final / "config.json").exists():
            log(f"[{tag}] reusing cached initial policy {final} (fitted by another run)")
            return final
        for stale in [*root.glob(f".{key}.*.tmp"), root / f".{key}.tmp"]:
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # no config.json: not a policy (a rename never leaves one half-written)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=root))
        log(f"[{tag}] fitting {what} ({cfg.steps} supervised steps) into {final}")
        try:
            fit(tmp)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _key_lock(path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` for the block (released when the process dies, too)."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_warm_policy(cfg: WarmStartConfig, log=print) -> Path:
    """The cached warm-started policy for ``cfg``, fitted first when absent (``cached_fit``)."""
    def fit(tmp: Path) -> Path:
        from launch.warmstart_fit import fit_policy  # torch, only when the cache has no policy

        return fit_policy(cfg, tmp, log=log)

    return cached_fit(cfg, cache_key(cfg), fit, "the initial policy", log=log)
