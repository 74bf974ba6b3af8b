"""Control plane: the TCPStore served by trainer rank 0, rendezvous records and key names.

Trainer and rollout workers are separate process trees (Slurm job steps); the store is the only
thing they share before the data-plane groups exist. Every module talks to it through a
``ControlStore`` (``control_store.py``): every call has a deadline, a failure names what was
awaited and who serves the store, and values are signed with the run's secret. Key names live in
``Keys`` so that no module invents its own.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import ipaddress
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass

import torch.distributed as dist

from megatron_darl.transport.config import ControlPlaneConfig
from megatron_darl.transport import ledger as _ledger
from megatron_darl.transport.control_store import (  # noqa: F401 (re-exported)
    ControlStore, ForeignValueError, TransportTimeout,
)

log = logging.getLogger(__name__)
TRAINER = "trainer"  # role of a Megatron trainer rank (hub, stage leader or rank 0)
WORKER = "rollout"  # role of a rollout worker


@dataclass(frozen=True)
class MemberInfo:
    """Who a process is: posted at rendezvous and in every heartbeat."""

    role: str  # TRAINER or WORKER
    rank: int  # trainer global rank, or rollout worker id
    host: str  # hostname the process runs on
    pid: int  # process id on that host

    def describe(self) -> str:
        """Human-readable name used in every error and report, e.g. ``rollout 3 (node7, pid 42)``."""
        return f"{self.role} {self.rank} ({self.host}, pid {self.pid})"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> "MemberInfo":
        return MemberInfo(**json.loads(text))

    @staticmethod
    def here(role: str, rank: int) -> "MemberInfo":
        """This process, as ``role`` ``rank``."""
        return MemberInfo(role=role, rank=rank, host=socket.gethostname(), pid=os.getpid())


class Keys:
    """Every key the transport writes into the store."""

    STOP = "ctl/stop"  # set once: workers drain and exit 0
    STARTED = _ledger.STARTED  # counter for the staleness bound (in the ledger, as every stale/ key)
    DROPPED = _ledger.DROPPED  # counter: groups a lost worker started and never delivered
    FENCED = _ledger.FENCED  # counter: groups a fenced (lost) generation sent later, refused
    REFUSED = _ledger.REFUSED  # counter: groups over the bound at the trainer, not trained
    DEGENERATE = _ledger.DEGENERATE  # counter: groups of equal rewards dropped at the hub (replay.fill_batch)

    @staticmethod
    def member(role: str, rank: int) -> str:
        return f"rdzv/{role}/{rank}"

    @staticmethod
    def exited(role: str, rank: int) -> str:
        return f"rdzv/{role}/{rank}/exited"

    @staticmethod
    def restarts(role: str, rank: int) -> str:
        """How many times the launcher started this member again (it may still be starting)."""
        return f"rdzv/{role}/{rank}/restarts"

    @staticmethod
    def groups_made(worker: int) -> str:
        """Where the worker's next group starts (groups made so far): the worker moves it as it
        starts groups, so a restarted process continues after its predecessor's ids; a resumed
        run's trainer seeds it with the groups it checkpointed as received (``loop/resume.py``)."""
        return f"darl/loop/resume/worker/{worker}"

    @staticmethod
    def heartbeat(role: str, rank: int) -> str:
        return f"hb/{role}/{rank}"

    @staticmethod
    def sample(hub: int, worker: int, seq: int) -> str:
        return f"ch/{hub}/{worker}/{seq}"

    @staticmethod
    def sample_ack(hub: int, worker: int) -> str:
        return f"ch/{hub}/{worker}/acked"

    @staticmethod
    def sample_epoch(hub: int, worker: int) -> str:
        """counter: the worker's data-plane pair to ``hub`` is rebuilt under a new epoch."""
        return f"ch/{hub}/{worker}/epoch"

    @staticmethod
    def sample_pair_ready(hub: int, worker: int, epoch: int) -> str:
        """Set by the hub as it starts building the pair of ``epoch``: the worker builds it then."""
        return f"ch/{hub}/{worker}/ready/{epoch}"

    @staticmethod
    def hub_info(hub: int) -> str:
        """JSON: the hub's host and GPU (the worker picks the pair's backend from it)."""
        return f"ch/{hub}/info"


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return address == "localhost"


def listen_socket(cfg: ControlPlaneConfig) -> socket.socket:
    """The store's listening socket, bound where configured: ``cfg.bind``, else the address
    ``cfg.host`` resolves to (TCPStore alone listens on every interface, whatever its host).

    One exception: a host *name* that resolves here to a loopback address (Debian maps the
    machine's own name to 127.0.1.1) while other nodes reach it by another address; then the
    store listens on every interface and says so (set ``transport.control.bind``).
    """
    address = cfg.bind or cfg.host
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, cfg.port, type=socket.SOCK_STREAM,
                                                        flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"transport.control.{'bind' if cfg.bind else 'host'}={address!r}: "
                         f"cannot resolve it ({exc.strerror})") from None
    if not cfg.bind and _loopback(sockaddr[0]) and not _loopback(cfg.host):
        log.warning("control store: host %r resolves here to %s, a loopback address: listening on "
                    "every interface so that other nodes can reach it (transport.control.bind "
                    "names the address to listen on)", cfg.host, sockaddr[0])
        family, sockaddr = socket.AF_INET6 if family == socket.AF_INET6 else socket.AF_INET, ("", cfg.port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"control store: cannot listen on {sockaddr[0] or '*'}:{cfg.port}: "
                      f"{exc.strerror}") from None
    return sock


def serve_store(cfg: ControlPlaneConfig) -> ControlStore:
    """Serve the control-plane store (trainer rank 0 only; port 0 is not allowed here) on
    ``listen_socket(cfg)`` and post the signed run record that joining processes check."""
    if cfg.port == 0:
        raise ValueError("ControlPlaneConfig.port is 0: the launcher picks the store's port "
                         "(launch.train or slurm/launch.sh); pass an explicit port otherwise")
    sock = listen_socket(cfg)
    try:
        server = dist.TCPStore(
            cfg.host, cfg.port, is_master=True, wait_for_workers=False,
            timeout=_dt.timedelta(seconds=cfg.store_timeout_s), master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the server listens on this descriptor from now on, and owns it
    # the ledger listens where the store does, on a port of its own (posted, signed)
    ledger = _ledger.LedgerServer(_ledger.Ledger(), listen_socket(dataclasses.replace(cfg, port=0)), cfg.secret)
    me = MemberInfo.here(TRAINER, 0)
    store = ControlStore(cfg, me.describe(), server=server, ledger=ledger)
    store.post_run_record(me.describe())
    return store


def connect_store(cfg: ControlPlaneConfig, who: str = "client") -> ControlStore:
    """Join the store served by trainer rank 0, waiting up to ``store_timeout_s`` for it.

    Raises:
        TransportTimeout: no store answered in time.
        ForeignValueError: the store is another run's (its run record is not signed with our secret).
    """
    store = ControlStore(cfg, who)
    try:
        store.check_run_record()
    except (RuntimeError, dist.DistError) as exc:
        store.close()
        raise TransportTimeout(
            f"{who}: no control-plane store at {cfg.host}:{cfg.port} (trainer rank 0) after "
            f"{cfg.store_timeout_s:.0f} s: {exc}") from exc
    except BaseException:
        store.close()
        raise
    return store


def register(store: ControlStore, me: MemberInfo) -> None:
    """Post this process's rendezvous record; a predecessor's exit record (a process of the same
    role and rank that left before this one started) no longer speaks for the member."""
    store.delete_key(Keys.exited(me.role, me.rank))
    store.set(Keys.member(me.role, me.rank), me.to_json())


def lookup(store: ControlStore, role: str, rank: int) -> MemberInfo | None:
    """Rendezvous record of ``role`` ``rank``, or None when it has not joined (or is forged)."""
    raw = store.read(Keys.member(role, rank))
    return None if raw is None else MemberInfo.from_json(raw)


def describe_peer(store: ControlStore, role: str, rank: int) -> str:
    """``MemberInfo.describe`` of a peer, or ``role rank (not joined)``."""
    try:
        info = lookup(store, role, rank)
    except (RuntimeError, dist.DistError, TransportTimeout):
        info = None
    return info.describe() if info is not None else f"{role} {rank} (not joined)"


def wait_key(store: ControlStore, key: str, timeout_s: float, what: str) -> None:
    """Block until ``key`` exists; on timeout raise ``TransportTimeout`` saying ``what`` was awaited."""
    store.wait([key], timeout_s, what)


def get_int(store: ControlStore, key: str, default: int) -> int:
    """Integer value of ``key``, or ``default`` when it is absent or foreign (never blocks)."""
    raw = store.read(key)
    return default if raw is None else int(raw)


def published_version(store: ControlStore) -> int:
    """Last weight version a live worker acked (0 before the first publish), from the ledger."""
    return int(store.ledger.call("published")["version"])


def publish_version(store: ControlStore, version: int) -> int:
    """Say that a live worker acked ``version``; the published version never moves back."""
    return int(store.ledger.call("publish", version=int(version))["version"])


def stop_requested(store: ControlStore) -> bool:
    """True once the trainer asked workers to drain and exit (a foreign stop flag is ignored)."""
    return store.read(Keys.STOP) is not None


def request_stop(store: ControlStore) -> None:
    """Ask every worker to finish its in-flight groups and exit 0."""
    store.set(Keys.STOP, "1")


def post_exit(store: ControlStore, me: MemberInfo, code: int) -> None:
    """Say this process is leaving cleanly (best effort: the store may already be gone)."""
    try:
        store.set(Keys.exited(me.role, me.rank), str(code))
    except (RuntimeError, dist.DistError, TransportTimeout):
        pass


def wait_for_exits(store: ControlStore, role: str, ranks: list[int], timeout_s: float,
                   poll_s: float = 0.01) -> list[int]:
    """Wait until every rank in ``ranks`` posted its exit; returns those that did not in time.

    Trainer rank 0 calls this before closing the store so that workers can drain and leave
    without seeing the store vanish under them.
    """
    deadline = time.monotonic() + timeout_s
    left = list(ranks)
    while left and time.monotonic() < deadline:
        left = [r for r in left if store.read(Keys.exited(role, r)) is None]
        if left:
            time.sleep(poll_s)
    return left
