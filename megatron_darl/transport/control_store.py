"""The one client of the control-plane TCPStore: a deadline on every call, signed values.

Why a wrapper and not ``torch.distributed.TCPStore`` itself. Measured with torch 2.13 (the
serving process SIGSTOPped, client ``timeout=2 s`` and ``set_timeout(2 s)``): ``check``, ``get``,
``add``, ``wait`` (even with its own 1 s timeout), ``delete_key``, ``multi_get`` and a new
connection all block for good (> 40 s, no error); only ``set`` returns, because it does not wait
for a reply. The C++ client logs "waitForInput ... timed out" and polls again. So every request
here runs on an I/O thread that owns the connection, and the caller waits at most its deadline.
A request that misses it leaves the connection out of step (a late reply would answer the wrong
request), so that thread is abandoned (it ends when the stuck call returns or the socket dies)
and the next request opens a new connection. Cost, measured on an idle 2-core machine: 57 us per
``check`` instead of 32 us (one thread hand-off). A frozen or unreachable store host costs a
caller exactly its deadline and raises ``TransportTimeout`` naming that host (role, rank, host,
pid, address); the heartbeat thread gives its calls what is left of the heartbeat timeout, so a
frozen trainer rank 0 is reported within it (``heartbeat.py``).

Per-run secret: every value written through ``set`` carries an HMAC-SHA256 tag (16 bytes) of the
key and the value under the run's secret (``ControlPlaneConfig.secret``, handed to every process
by the launcher). ``get`` refuses a value without a valid tag (``ForeignValueError``) and
``read`` treats it as absent (logged once per key), so a process without the secret cannot make
the run act on its writes: not stop it, not join it (the server's signed run record is checked
on connect; rendezvous records and heartbeats are checked by their readers), not post samples,
acks, versions or weight-sync headers. The staleness counters, the published version and the
workers' generations are not in the TCPStore at all: they live in the run's ledger on trainer
rank 0, which applies only requests of a connection that proved it holds the secret (``add`` of
a ``stale/`` key goes there; ``ledger.py``). What a TCPStore cannot enforce (it has no access
control, and ``list_keys`` shows every key, so secret key names would not help): a process that
reaches the port can still read values, delete or overwrite keys, replay the run's own earlier
values of a key, move the presence-only keys, and write the data-plane (gloo) rendezvous keys.
That disrupts a run (a named timeout or error) but cannot steer it or loosen the staleness
bound; keep the port on a private network or behind a firewall (docs/reliability.md).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import logging
import queue
import socket
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from megatron_darl.transport.config import ControlPlaneConfig
from megatron_darl.transport.errors import ForeignValueError, TransportTimeout  # noqa: F401 (re-exported)
from megatron_darl.transport.ledger import PREFIX as LEDGER_PREFIX
from megatron_darl.transport.ledger import LedgerClient, LedgerServer, LocalLedger

log = logging.getLogger(__name__)
RUN_KEY = "darl/run"  # signed record the server writes first: who serves this run's store
LEDGER_KEY = "darl/ledger"  # signed: the port of the run's ledger (``ledger.py``), on the store's host
_TAG_BYTES = 16  # truncated HMAC-SHA256 tag in front of every signed value
_WAIT_SLICE_S = 1.0  # a long wait is a series of native waits this long (each with a deadline)


class _Job:
    """One request for the I/O thread; the lock orders "started" against "cancelled"."""

    __slots__ = ("fn", "done", "lock", "started", "cancelled", "result", "error")

    def __init__(self, fn: Callable[[dist.Store], Any]) -> None:
        self.fn, self.done, self.lock = fn, threading.Event(), threading.Lock()
        self.started = self.cancelled = False
        self.result: Any = None
        self.error: BaseException | None = None


class _Connection:
    """One TCPStore client connection owned by one daemon I/O thread."""

    def __init__(self, opener: Callable[[threading.Event], dist.Store], name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False  # a request on it missed its deadline: never used again
        self.failed: BaseException | None = None  # the connection could not be opened
        self.listening = threading.Event()  # something accepts connections at the address
        threading.Thread(target=self._run, args=(opener,), name=name, daemon=True).start()

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self, opener: Callable[[threading.Event], dist.Store]) -> None:
        try:
            store = opener(self.listening)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
            self.failed, store = exc, None
            self.listening.set()
        while not self.abandoned:
            job = self._jobs.get()
            if job is None:
                return
            with job.lock:
                if job.cancelled:
                    continue
                job.started = True
            try:
                if store is None:
                    raise self.failed
                job.result = job.fn(store)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                job.error = exc
            job.done.set()


class ControlStore:
    """A connection to the run's control-plane store; see the module docstring.

    Args:
        cfg: where the store is, the call timeout and the run's secret.
        who: this process, for error messages (``MemberInfo.describe()``).
        server: the serving ``TCPStore`` on trainer rank 0 (kept alive here), else None.
    """

    def __init__(self, cfg: ControlPlaneConfig, who: str, server: dist.TCPStore | None = None,
                 ledger: LedgerServer | None = None) -> None:
        self.cfg, self.who, self._server, self._ledger_server = cfg, who, server, ledger
        self._ledger: LedgerClient | LocalLedger | None = LocalLedger(ledger.ledger) if ledger else None
        self.address = f"{cfg.host}:{cfg.port}"
        self.peer = f"trainer 0 (serving the control store at {self.address})"  # refined on connect
        self._key = cfg.secret.encode()
        self._conn: _Connection | None = None
        self._lock = threading.Lock()
        self._data_plane: dist.Store | None = server
        self._warned: set[str] = set()
        self._connect_budget_s = cfg.store_timeout_s  # the first connection may wait for the server

    # ---- signed values ----------------------------------------------------------------------
    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()[:_TAG_BYTES]

    def sign(self, key: str, value: str | bytes) -> bytes:
        """``value`` as stored under ``key``: its tag, then its bytes."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self._tag(key, data) + data

    def verify(self, key: str, stored: bytes) -> bytes:
        """The value inside ``stored``; ``ForeignValueError`` when its tag is not this run's."""
        data = stored[_TAG_BYTES:]
        if len(stored) < _TAG_BYTES or not hmac.compare_digest(stored[:_TAG_BYTES], self._tag(key, data)):
            raise ForeignValueError(
                f"{self.who}: store key {key!r} at {self.address} holds a value not signed with this "
                "run's secret (written by a process outside the run); ignored")
        return data

    # ---- requests ---------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes, timeout_s: float | None = None) -> None:
        signed = self.sign(key, value)
        self._call(f"set {key}", lambda s: s.set(key, signed), timeout_s)

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """The verified value of ``key`` (which must exist)."""
        return self.verify(key, self._call(f"get {key}", lambda s: s.get(key), timeout_s))

    def read(self, key: str, timeout_s: float | None = None) -> bytes | None:
        """The verified value of ``key``, or None when it is absent or foreign (logged once)."""
        stored = self._call(f"read {key}", lambda s: s.get(key) if s.check([key]) else None, timeout_s)
        if stored is None:
            return None
        try:
            return self.verify(key, stored)
        except ForeignValueError as exc:
            if key not in self._warned:
                self._warned.add(key)
                log.warning("%s", exc)
            return None

    def check(self, keys: list[str], timeout_s: float | None = None) -> bool:
        """True when every key exists (presence only: not verified)."""
        return bool(self._call(f"check {keys}", lambda s: s.check(keys), timeout_s))

    def add(self, key: str, amount: int, timeout_s: float | None = None) -> int:
        """Atomic counter. One under ``stale/`` lives in the run's ledger, which takes only
        authenticated requests (``ledger.py``); any other is a plain TCPStore counter, which a
        process outside the run could move (it carries no tag)."""
        if key.startswith(LEDGER_PREFIX):
            return int(self.ledger.call("add", key=key, amount=int(amount))["value"])
        return int(self._call(f"add {key}", lambda s: s.add(key, amount), timeout_s))

    @property
    def ledger(self) -> LedgerClient | LocalLedger:
        """The run's ledger (``ledger.py``): in process on trainer rank 0, else an authenticated
        connection to the port the server posted, signed, under ``LEDGER_KEY``."""
        if self._ledger is None:
            self.wait([LEDGER_KEY], self.cfg.store_timeout_s, "the run's ledger (trainer rank 0)")
            port = int(self.get(LEDGER_KEY))
            self._ledger = LedgerClient(self.cfg.host, port, self.cfg.secret, self.who, self.cfg.call_timeout_s)
        return self._ledger

    def delete_key(self, key: str, timeout_s: float | None = None) -> bool:
        return bool(self._call(f"delete {key}", lambda s: s.delete_key(key), timeout_s))

    def wait(self, keys: list[str], timeout_s: float, what: str) -> None:
        """Block until every key exists, at most ``timeout_s``; ``TransportTimeout`` names ``what``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(f"{self.who}: timed out after {timeout_s:.1f} s waiting for "
                                       f"{what} (key {', '.join(keys)})")
            piece = min(left, _WAIT_SLICE_S)
            try:
                self._call(f"wait {keys}", lambda s: s.wait(keys, _dt.timedelta(seconds=piece)),
                           piece + self.cfg.call_timeout_s)
                return
            except (RuntimeError, dist.DistError) as exc:
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise

    @property
    def data_plane(self) -> dist.Store:
        """A raw ``dist.Store`` for data-plane process groups (gloo/NCCL rendezvous keys)."""
        if self._data_plane is None:
            budget = self.cfg.call_timeout_s
            conn = _Connection(lambda listening: self._open(budget, listening), name="control-store-data-plane")
            job = _Job(lambda store: store)  # the connection's own store object, once opened
            conn.submit(job)
            if not job.done.wait(budget + 1.0):
                raise self._timeout("connect (data plane)", budget)
            conn.close()  # its thread ends; the store object lives on here
            if job.error is not None:
                raise job.error
            self._data_plane = job.result
        return self._data_plane

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            if self._server is None:
                self._data_plane = None

    # ---- machinery --------------------------------------------------------------------------
    def _await_listener(self, budget_s: float, listening: threading.Event) -> None:
        """Wait (``budget_s``) until something accepts TCP connections at the address.

        Why a plain socket first: a refused connection means "the server is not up yet", worth
        waiting ``store_timeout_s`` for; a frozen server accepts (the kernel completes the
        handshake) and then never answers, which must cost only the call's deadline. The
        TCPStore constructor cannot tell them apart and ignores its timeout on the latter.
        """
        deadline = time.monotonic() + budget_s
        while True:
            try:
                socket.create_connection((self.cfg.host, self.cfg.port), timeout=1.0).close()
                break
            except socket.timeout:
                break  # a listener with a full backlog: frozen or overloaded, not absent
            except OSError as exc:  # refused, unreachable, name not resolved yet
                if time.monotonic() + 0.2 >= deadline:
                    raise TransportTimeout(f"{self.who}: nothing listens at {self.address} (trainer rank 0's "
                                           f"control store) after {budget_s:.0f} s: {exc}") from exc
                time.sleep(0.2)
        listening.set()

    def _open(self, budget_s: float, listening: threading.Event) -> dist.TCPStore:
        """A client connection once a listener is there (see ``_await_listener``)."""
        self._await_listener(budget_s, listening)
        return dist.TCPStore(self.cfg.host, self.cfg.port, is_master=False,
                             timeout=_dt.timedelta(seconds=self.cfg.store_timeout_s))

    def _connection(self) -> tuple[_Connection, float]:
        """The live connection (opened on demand) and the extra time its opening may take: the
        first one may wait ``store_timeout_s`` for the server to come up, a reconnection none."""
        with self._lock:
            if self._conn is None or self._conn.abandoned or self._conn.failed is not None:
                if self._conn is not None:
                    self._conn.close()  # its thread ends now, or when its stuck call returns
                first = self._connect_budget_s
                self._connect_budget_s = 0.0
                budget = first or self.cfg.call_timeout_s
                self._conn = _Connection(lambda listening: self._open(budget, listening),
                                         name=f"control-store-io ({self.who})")
                return self._conn, first
            return self._conn, 0.0

    def _call(self, op: str, fn: Callable[[dist.Store], Any], timeout_s: float | None) -> Any:
        limit = self.cfg.call_timeout_s if timeout_s is None else max(timeout_s, 0.0)
        conn, opening = self._connection()
        job = _Job(fn)
        conn.submit(job)
        start = time.monotonic()
        if opening:  # a first connection: the server may not be listening yet
            conn.listening.wait(opening)
        waited = limit + (time.monotonic() - start if opening else 0.0)
        if not job.done.wait(max(0.0, start + waited - time.monotonic())):
            with job.lock:
                job.cancelled, started = True, job.started
            if started:  # the connection is out of step: never use it again
                conn.abandoned = True
            raise self._timeout(op, waited)
        if job.error is not None:
            if isinstance(job.error, dist.DistNetworkError):  # socket gone: reconnect next time
                conn.abandoned = True
            raise job.error
        return job.result

    def _timeout(self, op: str, waited_s: float) -> TransportTimeout:
        return TransportTimeout(f"{self.who}: {self.peer} did not answer {op} within {waited_s:.1f} s "
                                "(frozen or unreachable)")

    # ---- the run record ---------------------------------------------------------------------
    def post_run_record(self, server: str) -> None:
        """Server side: say who serves this run's store and where its ledger listens (a client
        that found the run record finds the ledger's port)."""
        self.peer = f"{server} serving the control store at {self.address}"
        if self._ledger_server is not None:
            self.set(LEDGER_KEY, str(self._ledger_server.port))
        self.set(RUN_KEY, json.dumps({"server": server}))

    def check_run_record(self) -> None:
        """Client side: wait for the server's record and check it is signed with our secret."""
        self._call("connect", lambda s: None, self.cfg.call_timeout_s)
        self.wait([RUN_KEY], self.cfg.store_timeout_s, "the control store's run record (trainer rank 0)")
        try:
            record = json.loads(self.get(RUN_KEY))
        except ForeignValueError:
            raise ForeignValueError(
                f"{self.who}: the control store at {self.address} is not this run's (its run record "
                "is not signed with this run's secret: another run on this port, or a different "
                "run secret); refusing to join") from None
        self.peer = f"{record['server']} serving the control store at {self.address}"
