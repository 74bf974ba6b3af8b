"""The run's ledger: the staleness counters, the published version and each worker's generation.

Why not the TCPStore: it has no access control, and its ``add`` counters cannot carry a tag of
the run's secret, so any local process that finds the port (``/proc/net/tcp``) could move the
staleness counter: down, and groups staler than the bound are generated; up, and the run stalls.
The ledger keeps these numbers in trainer rank 0's memory, next to the store it serves, and
changes them only on requests from a connection that proved it holds the run's secret:

- handshake: the server sends a random nonce; the client answers with a nonce of its own and an
  HMAC-SHA256 of both under the secret; the server answers with its own HMAC of both. Each side
  proves it holds the secret, neither sends it. A connection that fails is closed and logged
  with the address it came from; nothing it sent is applied.
- every request and answer after it carries an HMAC over a sequence number and its body, under a
  key drawn from both nonces: a request cannot be replayed, reordered or moved to another
  connection.

The ledger's port is posted in the store as a signed value (``Keys.LEDGER``; its host is the
store's), so a client finds it as it finds everything else and a forged port is refused. The
operations are the few the staleness bound needs, each atomic under one lock (``staleness.py``
holds the policy): ``add`` a counter, ``publish``/``published`` the version workers acked,
``join`` (a worker's next generation; the previous one is fenced), ``reserve`` group starts
against the bound (only by a worker's live generation; with too little room for them, the
starts given back, as many as fit), ``arrive`` (groups at their hub: a
fenced generation's are refused), ``fence`` (a lost worker: its outstanding starts are given
back), ``refuse`` (groups the trainer will not train: their starts are given back, counted by
why: over the bound, or degenerate under ``replay.fill_batch``) and ``filled`` (no live worker can
start a group before the next publish and none has one in flight: ``loop.wait_for_bound``).
A request may carry an id (``call_once``): the ledger answers an id it has seen with its first
answer and applies nothing again, so a counting request whose answer was lost can be sent again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
from collections import OrderedDict
from typing import Any

from megatron_darl.transport.errors import ForeignValueError, TransportTimeout, again_on_timeout
from megatron_darl.transport.shape import StalenessBound

log = logging.getLogger(__name__)
PREFIX = "stale/"  # every counter under it lives in the ledger, never in the open store
STARTED = "stale/groups_started"  # group starts reserved against the bound
DROPPED = "stale/groups_dropped"  # starts of a lost or replaced worker's generation, given back
FENCED = "stale/groups_fenced"  # groups a fenced generation sent later: refused at the hub
REFUSED = "stale/groups_refused"  # groups over the bound when they reached the trainer: not trained
DEGENERATE = "stale/groups_degenerate"  # groups of equal rewards dropped at the hub (replay.fill_batch)
GIVE_BACK = {"stale": REFUSED, "degenerate": DEGENERATE}  # ``refuse``'s reasons and their counters
_MAGIC = b"DLG1"
_MAC = 16  # bytes of a truncated HMAC-SHA256
_MAX_FRAME = 1 << 16  # a longer frame is not a ledger request
_HANDSHAKE_S = 5.0  # a connection must prove itself within this long
_REMEMBERED = 4096  # answers kept for requests that carry an id (``call_once``): a retry comes within seconds


def outstanding_key(worker: int) -> str:
    """Starts ``worker``'s live generation reserved whose groups have not reached a hub."""
    return f"{PREFIX}outstanding/{worker}"


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()[:_MAC]


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv(sock: socket.socket) -> bytes:
    (size,) = struct.unpack("<I", _exact(sock, 4))
    if size > _MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes")
    return _exact(sock, size)


def _exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("connection closed")
        out += chunk
    return bytes(out)


class Ledger:
    """The numbers themselves (trainer rank 0); ``apply`` runs one request atomically."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {}
        self._last: dict[int, int] = {}  # worker -> last generation issued
        self._live: dict[int, int] = {}  # worker -> its live generation (absent: fenced or none)
        self._wants: dict[int, int] = {}  # worker -> the size of its last reservation (a batch engine's batch)
        self._given_back = 0  # starts given back (refused, released) that no reservation has taken again
        self._published = 0
        self._answered: OrderedDict[str, dict[str, Any]] = OrderedDict()  # request id -> its answer

    def apply(self, req: dict[str, Any]) -> dict[str, Any]:
        """Run one request; one that carries an id (``request``) already answered gets that answer
        again and changes nothing (``call_once``)."""
        op = getattr(self, f"_op_{req.get('op')}", None)
        if op is None:
            raise ValueError(f"unknown ledger operation {req.get('op')!r}")
        rid = req.get("request")
        args = {k: v for k, v in req.items() if k not in ("op", "request")}
        with self._lock:
            if rid is not None and rid in self._answered:
                return dict(self._answered[rid])
            answer = op(**args)
            if rid is not None:
                self._answered[str(rid)] = dict(answer)
                while len(self._answered) > _REMEMBERED:
                    self._answered.popitem(last=False)
            return answer

    def _add(self, key: str, amount: int) -> int:
        self._counters[key] = self._counters.get(key, 0) + int(amount)
        return self._counters[key]

    def _op_add(self, key: str, amount: int) -> dict[str, Any]:
        if not key.startswith(PREFIX):
            raise ValueError(f"ledger key {key!r} is not under {PREFIX!r}")
        return {"value": self._add(key, amount)}

    def _op_publish(self, version: int) -> dict[str, Any]:
        self._published = max(self._published, int(version))
        return {"version": self._published}

    def _op_published(self) -> dict[str, Any]:
        return {"version": self._published}

    def _release(self, worker: int) -> int:
        """End ``worker``'s live generation; give back its outstanding starts (counted dropped)."""
        if self._live.pop(worker, None) is None:
            return 0
        n = max(0, self._counters.pop(outstanding_key(worker), 0))
        self._add(STARTED, -n)
        self._add(DROPPED, n)
        self._given_back += n
        return n

    def _op_fence(self, worker: int) -> dict[str, Any]:
        return {"released": self._release(worker)}

    def _op_join(self, worker: int) -> dict[str, Any]:
        released = self._release(worker)
        self._last[worker] = self._live[worker] = self._last.get(worker, 0) + 1
        return {"generation": self._live[worker], "released": released}

    def _op_reserve(self, worker: int, generation: int, count: int, max_staleness: int,
                    groups_per_step: int) -> dict[str, Any]:
        """``count`` starts when the bound has room for them. With less room, the starts given
        back since the last reservation (as many as fit): a batch engine that waits for room for
        its whole batch would otherwise wait forever for the replacements of dropped groups, which
        the trainer waits for (``replay.fill_batch``) and which no publish brings."""
        if worker >= 0 and self._live.get(worker) != generation:
            return {"fenced": True}
        if worker >= 0:
            self._wants[worker] = int(count)
        room = StalenessBound(max_staleness, groups_per_step).capacity(self._published) - self._counters.get(STARTED, 0)
        if count > room:
            count = min(room, self._given_back)
        if count < 1:
            return {"full": True, "version": self._published}
        self._given_back = max(0, self._given_back - count)
        if worker >= 0:
            self._add(outstanding_key(worker), count)
        return {"version": self._published, "last": self._add(STARTED, count), "count": count}

    def _op_filled(self, max_staleness: int, groups_per_step: int, version: int = 0) -> dict[str, Any]:
        """Whether every start the bound allows now has reached a hub: no live worker can reserve
        (the room left is smaller than each one's reservation, its last one's size, 1 before its
        first: a batch engine reserves whole batches, so the bound may be out of its reach; and no
        start given back waits to be taken again) and none has a start outstanding. False while no
        worker is live. The cap is that of ``version``, the trainer's, when the workers have not
        acked it yet: the starts its publish allows are still to come, whenever the ack lands."""
        cap = StalenessBound(max_staleness, groups_per_step).capacity(max(self._published, int(version)))
        room = cap - self._counters.get(STARTED, 0)
        live = list(self._live)
        reachable = room >= min((self._wants.get(w, 1) for w in live), default=1) or (
            room > 0 and self._given_back > 0)
        filled = bool(live) and not reachable and all(self._counters.get(outstanding_key(w), 0) <= 0 for w in live)
        return {"filled": filled}

    def _op_arrive(self, worker: int, generation: int, count: int) -> dict[str, Any]:
        if generation == 0:  # started by a gate that keeps no count
            return {"accepted": True}
        if self._live.get(worker) != generation:
            self._add(FENCED, count)
            return {"accepted": False}
        key = outstanding_key(worker)
        self._counters[key] = max(0, self._counters.get(key, 0) - count)
        return {"accepted": True}

    def _op_refuse(self, count: int, why: str = "stale") -> dict[str, Any]:
        """Give back the starts of ``count`` delivered groups the trainer will not train.

        Only groups a hub accepted reach here (``arrive``: a fenced generation's never do), so a
        start is given back once, whatever happens to its worker later."""
        if why not in GIVE_BACK:
            raise ValueError(f"refuse: unknown reason {why!r} (one of {sorted(GIVE_BACK)})")
        if int(count) < 0:
            raise ValueError(f"refuse: count {count} < 0")
        self._add(STARTED, -int(count))
        self._given_back += int(count)
        return {"refused": self._add(GIVE_BACK[why], int(count))}


def call_once(ledger: "LedgerClient | LocalLedger", op: str, tries: int = 3, **args: Any) -> dict[str, Any]:
    """``op`` applied once though it may be sent up to ``tries`` times. A call past its deadline
    may have been applied with only its answer lost, so a plain retry of a counting request
    (``arrive``, ``fence``) could count twice; every try here carries one request id, and the
    ledger answers an id it has seen with its first answer. For the requests whose loss costs the
    bound: a hub's ``arrive`` (else its link ends) and rank 0's ``fence`` of a lost worker (else
    the lost starts stay reserved until a process of that worker joins)."""
    rid = os.urandom(12).hex()
    return again_on_timeout(lambda: ledger.call(op, request=rid, **args), tries, f"ledger {op}, the same request")


class LedgerServer:
    """Serve ``ledger`` on ``sock`` (a bound, listening socket) to clients holding ``secret``."""

    def __init__(self, ledger: Ledger, sock: socket.socket, secret: str) -> None:
        self.ledger, self._sock, self._key = ledger, sock, secret.encode()
        self.port = sock.getsockname()[1]
        self.refused = 0  # connections that failed the handshake
        threading.Thread(target=self._accept, name="control-ledger", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"),
                             name="control-ledger-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with conn:
            try:
                session = self._handshake(conn)
            except (OSError, ValueError, ConnectionError) as exc:
                self.refused += 1
                log.warning("control ledger: refused the connection from %s: %s; nothing it sent "
                            "was applied", peer, exc)
                return
            conn.settimeout(None)
            seq = 0
            while True:
                try:
                    frame = _recv(conn)
                except (OSError, ValueError, ConnectionError):
                    return
                body, tag = frame[_MAC:], frame[:_MAC]
                if not hmac.compare_digest(tag, _mac(session, b"q", struct.pack("<Q", seq), body)):
                    log.warning("control ledger: a request from %s without a valid tag: connection "
                                "closed, nothing applied", peer)
                    return
                try:
                    answer = self.ledger.apply(json.loads(body))
                except (ValueError, TypeError, KeyError) as exc:
                    answer = {"error": str(exc)}
                out = json.dumps(answer).encode()
                _send(conn, _mac(session, b"a", struct.pack("<Q", seq), out) + out)
                seq += 1

    def _handshake(self, conn: socket.socket) -> bytes:
        conn.settimeout(_HANDSHAKE_S)
        ns = os.urandom(16)
        _send(conn, _MAGIC + ns)
        reply = _recv(conn)
        nc, tag = reply[:16], reply[16:]
        if len(nc) != 16 or not hmac.compare_digest(tag, _mac(self._key, b"client", ns, nc)):
            raise ValueError("its handshake is not signed with this run's secret")
        _send(conn, _mac(self._key, b"server", ns, nc))
        return _mac(self._key, b"session", ns, nc) + _mac(self._key, b"session2", ns, nc)


class LedgerClient:
    """One authenticated connection to the ledger (opened on first use, again after a failure).

    Args:
        who: this process, for error messages.
        timeout_s: deadline of the connection and of each request.
    """

    def __init__(self, host: str, port: int, secret: str, who: str, timeout_s: float) -> None:
        self.address, self.who, self._timeout = f"{host}:{port}", who, timeout_s
        self._host, self._port, self._key = host, port, secret.encode()
        self._sock: socket.socket | None = None
        self._session, self._seq = b"", 0
        self._lock = threading.Lock()

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """The ledger's answer to ``op``; ``TransportTimeout`` when it does not come in time."""
        body = json.dumps({"op": op, **args}).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._connect()
                seq = struct.pack("<Q", self._seq)
                _send(self._sock, _mac(self._session, b"q", seq, body) + body)
                frame = _recv(self._sock)
                self._seq += 1
            except ForeignValueError:
                self.close_locked()
                raise
            except (OSError, ValueError, ConnectionError) as exc:
                self.close_locked()
                raise TransportTimeout(f"{self.who}: the run's ledger at {self.address} (trainer rank 0) "
                                       f"did not answer {op}: {exc}") from None
            out, tag = frame[_MAC:], frame[:_MAC]
            if not hmac.compare_digest(tag, _mac(self._session, b"a", seq, out)):
                self.close_locked()
                raise ForeignValueError(f"{self.who}: an answer of the ledger at {self.address} "
                                        "is not signed for this connection")
        answer = json.loads(out)
        if "error" in answer:
            raise ValueError(f"{self.who}: the ledger at {self.address} refused {op}: {answer['error']}")
        return answer

    def _connect(self) -> None:
        sock = socket.create_connection((self._host, self._port), timeout=self._timeout)
        try:
            hello = _recv(sock)
            if hello[:4] != _MAGIC or len(hello) != 20:
                raise ValueError("not the run's ledger (bad greeting)")
            ns, nc = hello[4:], os.urandom(16)
            _send(sock, nc + _mac(self._key, b"client", ns, nc))
            if not hmac.compare_digest(_recv(sock), _mac(self._key, b"server", ns, nc)):
                raise ForeignValueError(f"{self.who}: the ledger at {self.address} is not this run's "
                                        "(its handshake is not signed with this run's secret)")
        except BaseException:
            sock.close()
            raise
        self._sock, self._seq = sock, 0
        self._session = _mac(self._key, b"session", ns, nc) + _mac(self._key, b"session2", ns, nc)

    def close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


class LocalLedger:
    """The ledger as trainer rank 0's own store sees it: no socket, the same operations."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        return self._ledger.apply({"op": op, **args})

    def close(self) -> None:
        pass
