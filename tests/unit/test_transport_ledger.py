"""The run's ledger: generations fence a lost worker, the trainer refuses groups over the bound,
and only a connection holding the secret changes anything (real server, real sockets)."""

from __future__ import annotations

import json
import socket
import struct

import pytest
import torch

from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.transport import StalenessBound, StalenessGate
from megatron_darl.transport.control_store import LEDGER_KEY
from megatron_darl.transport.ledger import LedgerClient
from megatron_darl.transport.staleness import admit_fresh, groups_refused, mark_delivered, release_reservations
from megatron_darl.transport.store import Keys, TransportTimeout, publish_version, published_version


def _group(group_id: int, version: int, worker: int = 0) -> SampleGroup:
    ids = torch.tensor([5, 6], dtype=torch.int64)
    sample = Sample(sample_id=group_id, prompt_ids=torch.tensor([1]), response_ids=ids,
                    behavior_logprobs=torch.zeros(2), token_versions=torch.full((2,), version))
    return SampleGroup(group_id=group_id, prompt_id=group_id, samples=[sample], worker_id=worker)


def test_a_fenced_generation_is_refused_and_the_worker_goes_on_as_a_new_one(stores):
    server, client = stores
    cfg = StalenessBound(max_staleness=0, groups_per_step=2)
    gate = StalenessGate(client, cfg, worker_id=0)
    held = gate.try_start_batch(2)
    assert [t.generation for t in held] == [1, 1] and gate.try_start() is None  # the bound: 2 at version 0
    assert release_reservations(server, 0) == 2 and release_reservations(server, 0) == 0  # declared lost
    assert server.add(Keys.STARTED, 0) == 0 and server.add(Keys.DROPPED, 0) == 2
    again = gate.try_start_batch(2)  # it was only frozen: it joins again and the slots are its anew
    assert gate.generation == 2 and [(t.index, t.generation) for t in again] == [(1, 2), (2, 2)]
    assert not mark_delivered(server, 0, 2, generation=1)  # the old batch arrives: refused, counted
    assert mark_delivered(server, 0, 2, generation=2) and gate.outstanding() == 0
    assert groups_refused(server) == {"fenced": 2, "stale": 0, "degenerate": 0} and server.add(Keys.STARTED, 0) == 2


def test_a_restarted_process_fences_its_predecessor(stores):
    server, client = stores
    cfg = StalenessBound(max_staleness=0, groups_per_step=4)
    first = StalenessGate(client, cfg, worker_id=1)
    assert len(first.try_start_batch(3)) == 3
    second = StalenessGate(server, cfg, worker_id=1)
    assert (second.generation, second.dropped) == (2, 3) and second.started() == 0
    assert not mark_delivered(server, 1, 1, generation=1)


def test_the_trainer_trains_no_group_over_the_bound_and_gives_its_start_back(stores):
    server, _ = stores
    gate = StalenessGate(server, StalenessBound(max_staleness=1, groups_per_step=3))
    assert len(gate.try_start_batch(3)) == 3
    groups = [_group(0, 4), _group(1, 3), _group(2, 2)]
    kept = admit_fresh(server, groups, version=4, max_staleness=1)
    assert [g.group_id for g in kept] == [0, 1]  # versions 4 and 3 at version 4; 2 is 2 old
    assert gate.started() == 2 and groups_refused(server)["stale"] == 1


def test_the_published_version_never_moves_back(stores):
    server, client = stores
    assert publish_version(client, 3) == 3 and publish_version(server, 2) == 3 and published_version(client) == 3


def test_only_the_run_secret_changes_the_ledger(control, stores, caplog):
    server, client = stores
    port = int(client.get(LEDGER_KEY))
    client.add(Keys.STARTED, 5)
    with pytest.raises(TransportTimeout, match="did not answer add"):
        LedgerClient(control.host, port, "guessed", "intruder", 5).call("add", key=Keys.STARTED, amount=-5)
    bare = socket.create_connection((control.host, port), timeout=5)  # a request with no handshake
    bare.recv(64)
    body = json.dumps({"op": "add", "key": Keys.STARTED, "amount": -5}).encode()
    bare.sendall(struct.pack("<I", len(body)) + body)
    assert bare.recv(64) == b""  # closed
    bare.close()
    assert server.add(Keys.STARTED, 0) == 5 and server._ledger_server.refused == 2
    assert sum("refused the connection from 127.0.0.1" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(ValueError, match="not under"):  # nothing outside the staleness keys
        client.ledger.call("add", key="ctl/stop", amount=1)
