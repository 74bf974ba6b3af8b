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
import os
import shutil
import socket
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from megatron_darl.models.config import WarmStartConfig

LOCK_WAIT_S = 1800.0  # longest a run waits for another's fit (the 57M task fit takes about a minute)


def cache_key(cfg: WarmStartConfig) -> str:
    """Stable hash of everything that determines the fitted policy (the cache dir excluded)."""
    payload = asdict(cfg)
    payload.pop("cache_dir")
    payload.pop("device")
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_fit(cfg: WarmStartConfig, key: str, fit: Callable[[Path], Path], what: str, log=print,
               tag: str = "warmstart", lock_wait_s: float = LOCK_WAIT_S) -> Path:
    """``cfg.cache_dir/key``, made by ``fit(tmp_dir)`` first when absent.

    Fitting writes to a temporary sibling directory of this process, renamed into place only on
    success, so an interrupted run never leaves a half-written policy in the cache. Runs started
    at once on one cache (a study's first runs, the ranks of a job) take a file lock per key: one
    fits, the others wait for it and reuse its policy; leftovers of a fit that died are removed
    under the lock. A wait longer than ``lock_wait_s`` raises ``TimeoutError`` naming the lock
    file and the process holding it (a hung fit must not hang every run behind it).
    """
    root = Path(cfg.cache_dir).expanduser()
    final = root / key
    if (final / "config.json").exists():
        log(f"[{tag}] reusing cached initial policy {final}")
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _key_lock(root / f".{key}.lock", lambda: log(f"[{tag}] waiting for another run fitting {final}"),
                   lock_wait_s):
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
def _key_lock(path: Path, on_wait: Callable[[], None], wait_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` for the block (released when the process dies, too),
    waited for at most ``wait_s``; the holder writes its host and pid into the file for the
    message of a run that gives up on it."""
    with open(path, "a+") as handle:
        deadline, waiting = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    on_wait()
                    waiting = True
                if time.monotonic() > deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "a process that wrote no name"
                    raise TimeoutError(f"{path}: held by {holder} for over {wait_s:.0f} s (a fit that "
                                       "hangs?); ending that process frees it") from None
                time.sleep(0.2)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
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
