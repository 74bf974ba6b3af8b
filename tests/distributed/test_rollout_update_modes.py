"""Weight syncs while groups are in flight: ``update_mode`` finish vs interrupt, per-token versions.

The real ``RolloutWorker`` (its own process tree, ``hf`` engine generating in chunks of 2 tokens,
up to 4 groups in flight) against a stand-in trainer that publishes a new version every 2 groups.
Long responses (40 tokens, 20 engine calls) make every publish land while groups are generating.
Checked from the hub's records of every token's version:

- ``finish``: no sample mixes versions (in-flight groups complete on the old weights before the
  load), and a group's version is never older than the one published when it started;
- ``interrupt``: samples do mix versions, each sample's versions never decrease (a token is
  produced by the newest weights loaded at that point), and none is newer than the last published.
"""

from __future__ import annotations

import pytest

from tests.distributed.procs.scenario import Scenario

STEPS, GPS = 5, 2


@pytest.mark.parametrize("mode", ["finish", "interrupt"])
def test_versions_per_token_follow_the_update_mode(tmp_path, mode):
    worker = ["--batch", "2", "--n", "2", "--max-new", "40", "--chunk-tokens", "2", "--max-inflight", "4",
              "--update-mode", mode]
    sc = Scenario(out=tmp_path, trainers=1, workers=1, stages=1, steps=STEPS, gps=GPS, eta=1,
                  trainer_args=["--join-timeout", "20"], worker_args={0: worker})
    procs = sc.launch()
    try:
        codes = {name: procs.wait(name, 240) for name in ["trainer0", "worker0"]}
        assert codes == {"trainer0": 0, "worker0": 0}, procs.logs()
    finally:
        procs.close()
    assert [r["version"] for r in sc.records("sync0.jsonl")] == list(range(1, STEPS + 1))
    recs = sc.records("hub0.jsonl")
    assert len(recs) >= STEPS * GPS
    mixed = 0
    for r in recs:
        for versions in r["token_versions"]:
            assert len(versions) == 40
            assert versions == sorted(versions), r["group_id"]  # never an older version after a newer one
            assert versions[0] >= r["start_version"] and versions[-1] <= STEPS
            mixed += len(set(versions)) > 1
    if mode == "finish":
        assert mixed == 0
    else:
        assert mixed >= 2, f"no sample spanned a weight load in {len(recs)} groups"
