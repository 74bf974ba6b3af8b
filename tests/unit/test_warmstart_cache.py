"""The warm-start cache under two first runs started at once (``launch/warmstart.py: cached_fit``).

Two real processes ask for the same missing key on one cache directory at the same moment. The
fit is the cache's real path with a fit that takes a second (it writes the policy's
``config.json`` after sleeping), so the two calls overlap whatever the machine: both must succeed
with the same directory, one must fit and the other reuse it, and nothing temporary is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from pathlib import Path
from launch.warmstart import cached_fit
from megatron_darl.models.config import WarmStartConfig

cache, go, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
while not go.exists():  # both processes start their call together
    time.sleep(0.01)

def fit(tmp: Path) -> Path:
    (cache.parent / f"fitted-by-{name}").touch()
    time.sleep(1.0)
    (tmp / "config.json").write_text(json.dumps({"by": name}))
    return tmp

path = cached_fit(WarmStartConfig(cache_dir=str(cache)), "k123", fit, "a test policy", log=lambda m: None)
print(json.dumps({"path": str(path), "by": json.loads((path / "config.json").read_text())["by"]}))
"""


def test_two_first_runs_at_once_both_get_the_one_fitted_policy(tmp_path: Path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(cache), str(go), name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    time.sleep(0.5)
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0] == outs[1] and outs[0]["path"] == str(cache / "k123")
    fitted = sorted(f.name for f in tmp_path.glob("fitted-by-*"))
    assert fitted == [f"fitted-by-{outs[0]['by']}"]  # one fitted, the other waited and reused it
    assert sorted(p.name for p in cache.iterdir()) == [".k123.lock", "k123"]  # no temporary left


def test_a_dead_fit_leaves_nothing_a_later_run_trips_on(tmp_path: Path):
    from launch.warmstart import cached_fit
    from megatron_darl.models.config import WarmStartConfig

    cache = tmp_path / "cache"
    cfg = WarmStartConfig(cache_dir=str(cache))

    def dies(tmp: Path) -> Path:
        (tmp / "half").write_text("x")
        raise RuntimeError("killed mid-fit")

    try:
        cached_fit(cfg, "k1", dies, "a test policy", log=lambda m: None)
    except RuntimeError:
        pass
    (cache / ".k1.tmp").mkdir()  # a leftover of the fixed temporary name older code used
    (cache / ".k1.tmp" / "x").write_text("x")

    def fits(tmp: Path) -> Path:
        (tmp / "config.json").write_text("{}")
        return tmp

    assert cached_fit(cfg, "k1", fits, "a test policy", log=lambda m: None) == cache / "k1"
    assert sorted(p.name for p in cache.iterdir()) == [".k1.lock", "k1"]


HOLDER = r"""
import json, sys, time
from pathlib import Path
from launch.warmstart import cached_fit
from megatron_darl.models.config import WarmStartConfig

cache, release = Path(sys.argv[1]), Path(sys.argv[2])

def fit(tmp: Path) -> Path:
    (cache.parent / "fitting").touch()
    while not release.exists():  # a fit that does not end until the test lets it
        time.sleep(0.05)
    (tmp / "config.json").write_text("{}")
    return tmp

print(cached_fit(WarmStartConfig(cache_dir=str(cache)), "k7", fit, "a test policy", log=lambda m: None))
"""


def test_a_run_behind_a_hung_fit_gives_up_naming_the_holder(tmp_path: Path):
    from launch.warmstart import cached_fit
    from megatron_darl.models.config import WarmStartConfig

    cache, release = tmp_path / "cache", tmp_path / "release"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache), str(release)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "fitting").exists():
            assert holder.poll() is None and time.monotonic() < deadline, holder.stderr.read()
            time.sleep(0.05)
        cfg, waits = WarmStartConfig(cache_dir=str(cache)), []
        began = time.monotonic()
        try:
            cached_fit(cfg, "k7", lambda tmp: tmp, "a test policy", log=waits.append, lock_wait_s=0.5)
            raise AssertionError("a run behind a fit that never ends returned")
        except TimeoutError as exc:
            message = str(exc)
        assert 0.5 <= time.monotonic() - began < 30
        assert str(cache / ".k7.lock") in message and f"pid {holder.pid} on " in message, message
        assert len(waits) == 1 and "waiting for another run" in waits[0]
        release.touch()  # the fit ends: the next run reuses its policy
        out, err = holder.communicate(timeout=60)
        assert holder.returncode == 0, err[-2000:]
        assert cached_fit(cfg, "k7", lambda tmp: tmp, "a test policy", log=lambda m: None) == cache / "k7"
    finally:
        holder.kill()
