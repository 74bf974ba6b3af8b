"""Sample channel under load: two workers x 500 groups into a deliberately slow trainer hub.

The trainer (its own process tree, with a gloo default group) sleeps per received group and
publishes a new version (a real weight sync) every ``gps`` groups; worker 1 stalls for seconds in
the middle of the run. Checked from the hub's records: every group arrives exactly once, the
staleness bound held when each group was started, and worker 0's groups kept flowing while
worker 1 was stalled.
"""

from __future__ import annotations

import json

from megatron_darl.transport.shape import StalenessBound
from tests.distributed.procs.scenario import Scenario

GROUPS, GPS, ETA = 500, 10, 2


def test_two_workers_500_groups_exactly_once_bounded_staleness_stall_isolated(tmp_path):
    sc = Scenario(out=tmp_path, trainers=1, workers=2, stages=1, steps=GROUPS // GPS, gps=GPS, eta=ETA,
                  trainer_args=["--hub-delay-s", "0.01", "--join-timeout", "2"],
                  worker_args={w: ["--batch", "5", "--n", "2", "--max-new", "3", "--join-timeout", "2"]
                               for w in range(2)})
    # from its 20th engine call (both workers are producing by then, whichever started late) for
    # 6 s: each weight sync meanwhile waits join_timeout (2 s) for the stalled worker, so the trainer
    # takes at least two steps during the stall whatever the other worker had queued before it
    sc.worker_args[1] += ["--stall-at", "20", "--stall-s", "6"]
    procs = sc.launch()
    try:
        codes = {name: procs.wait(name, 200) for name in ["trainer0", "worker0", "worker1"]}
        assert codes == {"trainer0": 0, "worker0": 0, "worker1": 0}, procs.logs()
    finally:
        procs.close()
    recs = sc.records("hub0.jsonl")
    done = sc.records("done.jsonl")[0]
    ids = [r["group_id"] for r in recs]
    # exactly once: every started group arrived, none twice, per-worker sequences have no gaps
    assert len(recs) >= GROUPS and len(ids) == len(set(ids)) == done["started"]
    assert done["duplicates"] == 0
    for w in range(2):
        seqs = sorted(r["seq"] for r in recs if r["worker"] == w)
        assert seqs == list(range(len(seqs))) and seqs
    # staleness bound at the start of every group; tokens never older than the version then published
    for r in recs:
        assert r["started_index"] <= StalenessBound(ETA, GPS).capacity(r["start_version"]), r
        assert r["min_token_version"] >= r["start_version"], r
    assert sorted(r["started_index"] for r in recs) == list(range(1, len(recs) + 1))
    # the stalled worker did not hold up the other's groups
    stall = json.loads((tmp_path / "stall1.json").read_text())
    during = [r for r in recs if stall["start"] < r["time"] < stall["end"]]
    # (worker 1's groups posted before the stall may still be taken during it; it posts no new ones)
    assert sum(r["worker"] == 0 for r in during) >= GPS
    assert [r["version"] for r in sc.records("sync0.jsonl")] == list(range(1, GROUPS // GPS + 1))
