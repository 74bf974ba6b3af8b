"""The run's ledger: generations fence a lost worker, the trainer refuses groups over the bound,
and only a connection holding the secret changes anything (real server, real sockets)."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest
import torch

from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.transport import StalenessBound, StalenessGate
from megatron_darl.transport.control_store import LEDGER_KEY
from megatron_darl.transport.ledger import DROPPED, STARTED, Ledger, LedgerClient, LedgerServer, call_once
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


class _LosesFirstAnswer:
    """A TCP relay in front of the ledger whose first connection passes the client's request on
    and holds back the ledger's answer (the network lost it): the client's call runs past its
    deadline though the ledger applied it. Later connections are relayed whole."""

    def __init__(self, target_port: int) -> None:
        self._target, self.held_back, self._conns = target_port, 0, 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            self._conns += 1
            server = socket.create_connection(("127.0.0.1", self._target))
            lose = self._conns == 1
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, 3 if lose else None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, hold_frame: int | None) -> None:
        frames = 0
        try:
            while True:
                head = src.recv(4, socket.MSG_WAITALL)
                if len(head) < 4:
                    return
                body = src.recv(struct.unpack("<I", head)[0], socket.MSG_WAITALL)
                frames += 1
                if frames == hold_frame:  # hello, handshake, then the first answer: held back
                    self.held_back += 1
                    continue
                dst.sendall(head + body)
        except OSError:
            return

    def close(self) -> None:
        self._sock.close()


def test_a_counting_request_whose_answer_was_lost_is_applied_once():
    """``arrive`` and ``fence`` through a relay that loses the first answer: ``call_once`` tries
    again on a new connection, as the same request, and the ledger counts it once (a plain retry
    would give back the worker's other reservation as delivered) and answers as the first time."""
    ledger = Ledger()
    sock = socket.create_server(("127.0.0.1", 0))
    LedgerServer(ledger, sock, "run-secret")
    ledger.apply({"op": "join", "worker": 0})
    got = ledger.apply({"op": "reserve", "worker": 0, "generation": 1, "count": 3, "max_staleness": 1,
                        "groups_per_step": 2})
    assert got["count"] == 3
    for op, args, answer in (("arrive", {"worker": 0, "generation": 1, "count": 2}, {"accepted": True}),
                             ("fence", {"worker": 0}, {"released": 1})):
        relay = _LosesFirstAnswer(sock.getsockname()[1])
        client = LedgerClient("127.0.0.1", relay.port, "run-secret", "hub 0", timeout_s=0.5)
        assert call_once(client, op, **args) == answer  # the first answer, not the second try's
        assert relay.held_back == 1
        client.close()
        relay.close()
    assert ledger.apply({"op": "add", "key": DROPPED, "amount": 0})["value"] == 1  # 3 reserved, 2 arrived
    assert ledger.apply({"op": "add", "key": STARTED, "amount": 0})["value"] == 2
    with pytest.raises(TransportTimeout):  # every try lost: the caller hears of it
        relay = _LosesFirstAnswer(sock.getsockname()[1])
        call_once(LedgerClient("127.0.0.1", relay.port, "run-secret", "hub 0", timeout_s=0.5), "published",
                  tries=1)
    sock.close()
