"""Heartbeats and peer monitoring over the control-plane store.

Why a counter and not a timestamp: trainer and rollout run on different hosts whose clocks need
not agree, so each process posts an increasing beat number and a monitor measures, on its own
clock, how long a peer's beat has not changed. One background thread per process both posts its
own beat and watches its peers, on its own store connection (a blocked main thread, e.g. in a
long generate or collective, does not stop the beat). A peer silent for ``timeout_s`` is reported
once, by role, rank and host; the owner decides what that means (the trainer goes on, a worker
exits non-zero). The store host itself (trainer rank 0) is watched through the thread's own store
calls: each gets what is left of ``timeout_s`` since the last call that succeeded as its deadline
(``ControlStore``), but two beat intervals at least, so a frozen or unreachable rank 0 is reported
within ``timeout_s`` (``timeout_s`` + two intervals when this thread itself ran late: a process
busy or holding the GIL has not asked, and its lateness is not the host's silence) even though
the store client itself would wait forever. Beats and rendezvous records are signed: a foreign
process cannot keep a dead peer "alive" or pose as a member. Each beat also carries the
process's event counters (``megatron_darl.counters``), which the trainer sums into its metrics
(a worker also posts them before sending groups, ``post_counters``, so a step's metrics count the
errors of the groups it trained, not a beat later), and the owner's own cumulative statistics
(``stats``: a rollout worker's engine, sync and batch seconds and counts), which the trainer reads
per peer (``peer_stats``) for per-worker metrics.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from megatron_darl import counters
from megatron_darl.transport.config import ControlPlaneConfig, HeartbeatConfig
from megatron_darl.transport.store import ControlStore, Keys, MemberInfo, TransportTimeout, connect_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerLoss:
    """One report of a silent peer (or of the store itself going away)."""

    peer: str  # MemberInfo.describe() of the peer (for rank 0: "... serving the control store at ...")
    role: str  # role of the lost peer
    rank: int  # rank of the lost peer
    silent_s: float  # seconds since its last observed beat
    step: int  # the owner's step (Heartbeat.step) when the loss was noticed
    replaced_by: str = ""  # a new process of the same role and rank beats in its place (restarted)


class Heartbeat:
    """Post this process's beat and report watched peers that fall silent.

    Args:
        control: where the store is; the thread opens its own connection.
        cfg: beat interval and timeout.
        me: this process.
        watch: ``(role, rank)`` of the peers to monitor; a peer counts from its first beat.
        on_loss: called once per lost peer from the heartbeat thread.
        store_is_peer: the member whose loss the store becoming unreachable means (the trainer
            rank 0 that serves it); ``None`` on trainer rank 0 itself.
        stats: returns the owner's cumulative statistics (name -> number), sent with each beat.
    """

    def __init__(
        self,
        control: ControlPlaneConfig,
        cfg: HeartbeatConfig,
        me: MemberInfo,
        watch: list[tuple[str, int]] = (),
        on_loss: Callable[[PeerLoss], None] | None = None,
        store_is_peer: tuple[str, int] | None = None,
        stats: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.cfg, self.me, self.step = cfg, me, 0
        self._control = control
        self._watch = list(watch)
        self._on_loss = on_loss or (lambda loss: None)
        self._store_peer = store_is_peer
        self._seen: dict[tuple[str, int], tuple[str, float, MemberInfo]] = {}  # value, when, who
        self._incarnations: dict[tuple[str, int], int] = {}  # processes seen beating per peer
        self._losses: dict[str, int] = {}  # per role: peer processes reported lost (silent, or replaced)
        self._lost: dict[tuple[str, int], PeerLoss] = {}
        self._counters: dict[tuple[str, int], dict[str, int]] = {}  # highest counters of each peer's process
        self._retired: dict[str, float] = {}  # the last counters of peer processes replaced by a restart
        self._n = 0  # this process's last beat number
        self._posted: dict[str, int] = {}  # the counters of this process's last beat
        self._stats_fn = stats
        self._stats: dict[tuple[str, int], dict[str, float]] = {}  # latest stats per peer
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store: ControlStore | None = None
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{me.role}-{me.rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._store = connect_store(self._control, who=self.me.describe())
        self._beat(self._store, 0)
        self._thread.start()
        return self

    def watch(self, role: str, rank: int) -> None:
        """Add a peer to the watch list."""
        with self._lock:
            if (role, rank) not in self._watch:
                self._watch.append((role, rank))

    def unwatch(self, role: str, rank: int) -> None:
        """Stop watching a peer: from now on it may leave without being reported (a run's end)."""
        with self._lock:
            if (role, rank) in self._watch:
                self._watch.remove((role, rank))
            self._lost.pop((role, rank), None)

    def lost(self) -> list[PeerLoss]:
        """Peers reported lost and not back since."""
        with self._lock:
            return list(self._lost.values())

    def is_lost(self, role: str, rank: int) -> bool:
        """Reported lost and not beating again since."""
        with self._lock:
            return (role, rank) in self._lost

    def post_counters(self, store: ControlStore) -> None:
        """Beat now, from the caller's thread and store connection, if this process's counters
        changed since its last beat. A worker calls it before sending the groups the counts are
        about: the beat is a round trip, so the counts are in the store before the groups reach
        the trainer, whose ``refresh`` before its metrics then reads them (not a beat later)."""
        if counters.snapshot() != self._posted:
            self._beat(store, self._n, time.monotonic() + self.cfg.timeout_s)

    def refresh(self, store: ControlStore) -> None:
        """Look at every watched peer now, from the caller's thread and store connection."""
        self._check_peers(store)

    def peer_counters(self) -> dict[str, float]:
        """Sum over watched peers of their event counters (those of lost processes and of processes a
        restart replaced included); the known counters are always present."""
        with self._lock:
            latest = list(self._counters.values()) + [dict(self._retired)]
        total = {counters.REWARD_ERRORS: 0.0, counters.REWARD_TIMEOUTS: 0.0}
        for peer in latest:
            for name, value in peer.items():
                total[name] = total.get(name, 0.0) + float(value)
        return total

    def peer_stats(self, role: str, rank: int) -> dict[str, float]:
        """The latest statistics a peer sent with its beat ({} before its first)."""
        with self._lock:
            return dict(self._stats.get((role, rank), {}))

    def is_alive(self, role: str, rank: int) -> bool:
        """Seen beating and not currently lost."""
        with self._lock:
            return (role, rank) in self._seen and (role, rank) not in self._lost

    def member(self, role: str, rank: int) -> MemberInfo | None:
        """The process last seen beating as ``role`` ``rank`` (None before its first beat)."""
        with self._lock:
            seen = self._seen.get((role, rank))
            return seen[2] if seen is not None else None

    def losses(self, role: str) -> int:
        """Processes of ``role`` reported lost so far (silent, or replaced by a restarted one)."""
        with self._lock:
            return self._losses.get(role, 0)

    def incarnations(self, role: str, rank: int) -> int:
        """How many processes have beaten as ``role`` ``rank`` (a restart makes one more)."""
        with self._lock:
            return self._incarnations.get((role, rank), 0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.cfg.interval_s + 1)

    def _beat(self, store: ControlStore, n: int, deadline: float | None = None) -> None:
        stats = self._stats_fn() if self._stats_fn is not None else {}
        snapshot = counters.snapshot()
        payload = json.dumps({"beat": n, "member": self.me.to_json(), "counters": snapshot, "stats": stats})
        key = Keys.heartbeat(self.me.role, self.me.rank)
        store.set(key, payload, timeout_s=_left(deadline))
        # A set is not answered (it returns even with the host frozen); one round trip per beat
        # is what proves the store host alive, also for a process that watches no peer.
        store.check([key], timeout_s=_left(deadline))
        self._n, self._posted = n, snapshot

    def _run(self) -> None:
        store_ok_at = time.monotonic()
        while not self._stop.wait(self.cfg.interval_s):
            n = self._n + 1
            # every call below ends by the timeout after the last answer, but gets two intervals at
            # least: a thread that woke late (its own process busy, or holding the GIL) has not
            # asked, and the store host's silence is only what it leaves unanswered when asked
            deadline = max(store_ok_at + self.cfg.timeout_s, time.monotonic() + 2 * self.cfg.interval_s)
            try:
                self._beat(self._store, n, deadline)
                self._check_peers(self._store, deadline)
                store_ok_at = time.monotonic()
            except (RuntimeError, dist.DistError, OSError) as exc:  # TransportTimeout included
                silent = time.monotonic() - store_ok_at
                if self._store_peer is not None and silent >= self.cfg.timeout_s:
                    role, rank = self._store_peer
                    what = "frozen" if isinstance(exc, TransportTimeout) else f"unreachable: {exc}"
                    peer = f"{self._store.peer} ({what})"
                    self._report(PeerLoss(peer, role, rank, silent, self.step), (role, rank))
                    return

    def _check_peers(self, store: ControlStore, deadline: float | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            watch = list(self._watch)
        keys = [Keys.heartbeat(r, k) for r, k in watch]
        for (role, rank), key in zip(watch, keys):
            value = store.read(key, timeout_s=_left(deadline))
            if value is None:
                continue
            raw = value.decode()
            with self._lock:
                prev = self._seen.get((role, rank))
            if prev is None or prev[0] != raw:
                beat = json.loads(raw)
                member = MemberInfo.from_json(beat["member"])
                with self._lock:
                    if self._seen.get((role, rank)) is not prev:  # another thread took this beat
                        continue
                    replaced = prev is not None and prev[2] != member
                    if prev is None or replaced:
                        self._incarnations[(role, rank)] = self._incarnations.get((role, rank), 0) + 1
                    self._seen[(role, rank)] = (raw, now, member)
                    if replaced:  # the old process's counts stay in the sums
                        for name, value in self._counters.pop((role, rank), {}).items():
                            self._retired[name] = self._retired.get(name, 0.0) + float(value)
                    # counts only grow within a process; beats posted from two threads may land
                    # out of order (post_counters), so keep each count's highest
                    mine = self._counters.setdefault((role, rank), {})
                    for name, value in beat.get("counters", {}).items():
                        mine[name] = max(mine.get(name, 0), value)
                    self._stats[(role, rank)] = dict(beat.get("stats", {}))
                    back = self._lost.pop((role, rank), None)
                if replaced and back is None:  # a new process beats in the place of a live one
                    self._report(PeerLoss(prev[2].describe(), role, rank, now - prev[1], self.step,
                                          replaced_by=member.describe()), None)
                if back is not None:
                    log.warning("%s is beating again (step %d)", member.describe(), self.step)
                continue
            silent = now - prev[1]
            with self._lock:
                watched = (role, rank) in self._watch
            if silent > self.cfg.timeout_s and (role, rank) not in self._lost and watched:
                self._report(PeerLoss(prev[2].describe(), role, rank, silent, self.step), (role, rank))

    def _report(self, loss: PeerLoss, key: tuple[str, int] | None) -> None:
        """Log and hand on one loss, once; ``key`` stays lost until it beats again (None: it
        already does, as a new process)."""
        with self._lock:
            if key is not None:
                if key in self._lost:  # another thread reported it first
                    return
                self._lost[key] = loss
            self._losses[loss.role] = self._losses.get(loss.role, 0) + 1
        if loss.replaced_by:
            log.error("%s lost: %s beats in its place (restarted) at step %d", loss.peer,
                      loss.replaced_by, loss.step)
        else:
            log.error("%s lost: no heartbeat for %.1f s (timeout %.1f s) at step %d",
                      loss.peer, loss.silent_s, self.cfg.timeout_s, loss.step)
        self._on_loss(loss)


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (at least a moment), or None: the store's own call timeout."""
    return None if deadline is None else max(0.05, deadline - time.monotonic())
