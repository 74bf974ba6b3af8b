"""A trainer rank's ends of the transport, and the few collectives the loop adds on top.

Rank 0 serves the control-plane store; every rank registers and beats. Rank 0 watches the other
trainer ranks' beats and they watch rank 0 through the store: a trainer rank frozen or gone for
``heartbeat.timeout_s`` ends the run with one line naming it (its peers' collectives would
otherwise wait ``parallel.timeout_s`` and end in a raw gloo/NCCL timeout). The replica's hub
(TP 0, first PP stage) owns a ``SampleHub`` (its DP shard of the groups); the leader of each PP
stage in DP replica 0 (TP 0) owns a ``WeightSender``. Hubs agree on "enough groups arrived" with
a sum over the hubs' gloo DP group. The groups stay on the hub (the replay state lives there
only); the other ranks of its replica serve the passes the hub makes while it waits and learn
whether the step goes on (``StepRunner.follow_wait``), and get the step's batches later
(``replica.py``).

Rank 0 also watches progress while it waits (``ProgressWatch``): when no group arrived for
``loop.receive_timeout_s``, or every rollout worker is lost, all ranks leave the wait together
with one line that names each worker's state, and the loop checkpoints and stops (a hang is a
bug, docs/architecture.md, Failures). One lost worker is not the run: its loss is one line in the log and a
count in the metrics (``worker_health``), and the others go on; a worker the launcher is starting
again (``Keys.restarts``) is not gone yet, and rejoins when its new process beats.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_darl.exit_codes import ExitCode
from megatron_darl.samples import SampleGroup
from megatron_darl.transport import (
    TRAINER, WORKER, Heartbeat, MemberInfo, PeerLoss, SampleHub, StalenessBound, Topology, TransportConfig,
    WeightSender, connect_store, register, serve_store,
)
from megatron_darl.algorithms import rewards_equal
from megatron_darl.transport.staleness import (
    admit_fresh, give_back_degenerate, groups_dropped, groups_refused, release_reservations,
)
from megatron_darl.transport.store import Keys, describe_peer, get_int, published_version, wait_key
from megatron_darl.transport.weight_publisher import BackgroundPublisher
from megatron_darl.transport.weight_protocol import SyncKeys, SyncReport

log = logging.getLogger(__name__)


@dataclass
class TrainerEndpoints:
    """What one trainer rank holds of the transport."""

    store: Any  # transport.ControlStore (the store is served by rank 0)
    heartbeat: Heartbeat  # this rank's beat and the watch on rollout workers
    hub: SampleHub | None  # this replica's shard of the sample channel (hub ranks only)
    sender: WeightSender | None  # this PP stage's weight broadcast (stage leaders only)
    me: MemberInfo  # this rank's rendezvous record
    bound: StalenessBound  # eta: the hub refuses groups older than the bound (``admit_fresh``)
    publisher: BackgroundPublisher | None = None  # the sender's thread (weight_sync.background)
    last_group_at: float = field(default_factory=time.monotonic)  # rank 0: when a group last arrived

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.hub is not None:
            self.hub.close()
        self.heartbeat.close()


def _release_on_loss(transport: TransportConfig, leave: Callable[[PeerLoss], None]):
    """Rank 0's heartbeat callback: a lost worker is named and the staleness reservations of the
    groups that died with it given back (training goes on; a restarted process gives back its
    predecessor's itself, before it reserves: here they could already be its own); a lost
    trainer rank ends this one (``leave``)."""
    store = connect_store(transport.control, who="trainer 0 loss handler")

    def on_loss(loss: PeerLoss) -> None:
        if loss.role == TRAINER:
            leave(loss)
        elif loss.replaced_by:
            log.error("lost %s at step %d: it died and %s beats in its place (restarted); its groups in "
                      "flight are dropped", loss.peer, loss.step, loss.replaced_by)
        else:
            try:
                released = release_reservations(store, loss.rank)  # fences it, should it come back
            except (RuntimeError, OSError) as exc:  # TransportTimeout too, after the tries of ``call_once``
                log.error("lost %s at step %d: no heartbeat for %.1f s; its starts in flight could not be given "
                          "back (%s): the staleness bound stays that much tighter until a process of rollout %d "
                          "joins (a restart gives them back)", loss.peer, loss.step, loss.silent_s, exc, loss.rank)
                return
            log.error("lost %s at step %d: no heartbeat for %.1f s (killed, crashed or frozen); %d groups "
                      "in flight dropped; training goes on with the other workers", loss.peer, loss.step,
                      loss.silent_s, released)

    return on_loss


def worker_health(ep: "TrainerEndpoints", num_workers: int) -> dict[str, float]:
    """Rank 0's per-step rollout-side health: workers beating now, worker processes lost and
    restarted so far, the groups that died with them (started, never delivered), and the groups
    refused so far: sent by a worker after it was declared lost (``groups_fenced``), over
    ``max_staleness`` when they reached the trainer (``groups_refused_stale``), or of equal rewards
    under ``replay.fill_batch`` (``groups_refused_degenerate``); none is trained."""
    hb = ep.heartbeat
    refused = groups_refused(ep.store)
    return {"workers_alive": float(sum(hb.is_alive(WORKER, w) for w in range(num_workers))),
            "workers_lost": float(hb.losses(WORKER)),
            "worker_restarts": float(sum(max(0, hb.incarnations(WORKER, w) - 1) for w in range(num_workers))),
            "groups_dropped": float(groups_dropped(ep.store)),
            "groups_fenced": float(refused["fenced"]), "groups_refused_stale": float(refused["stale"]),
            "groups_refused_degenerate": float(refused["degenerate"])}


def _leave_on_trainer_loss(rank: int, say_why: Callable[[str], None]) -> Callable[[PeerLoss], None]:
    """Heartbeat callback for a lost trainer rank: this rank's next collective with it would wait
    ``parallel.timeout_s`` (600 s) and end in a raw gloo/NCCL timeout, and no checkpoint can be
    written without it (saving is collective), so the rank says why (``say_why``: the loop adds the
    newest checkpoint and writes the line for the launcher) and exits ``ExitCode.TRAINER_LOST`` now."""
    def leave(loss: PeerLoss) -> None:
        say_why(f"trainer rank {rank}: lost {loss.peer}: no heartbeat for {loss.silent_s:.1f} s "
                f"(transport.heartbeat.timeout_s) at step {loss.step}; the run cannot go on without it "
                f"and cannot checkpoint without it (a checkpoint is collective)")
        logging.shutdown()
        os._exit(ExitCode.TRAINER_LOST)

    return leave


def open_endpoints(transport: TransportConfig, bound: StalenessBound, topology: Topology, ps,
                   stage_bytes: int = 0, say_why: Callable[[str], None] | None = None) -> TrainerEndpoints:
    """Serve or join the store, start the heartbeat, and open this rank's hub/sender (with its
    background thread when ``weight_sync.background`` allows it for ``stage_bytes`` per copy).
    ``bound`` and ``topology`` are the run's (``RunConfig.bound``, ``RunConfig.topology``).

    Every trainer rank is watched: rank 0 watches the others' beats, they watch rank 0 through
    the store it serves; a lost one ends the run within ``heartbeat.timeout_s``, with
    ``say_why`` (default: the log) given the one line naming it."""
    control = transport.control
    store = serve_store(control) if ps.rank == 0 else connect_store(control, who=f"trainer {ps.rank}")
    me = MemberInfo.here(TRAINER, ps.rank)
    register(store, me)
    leave = _leave_on_trainer_loss(ps.rank, say_why or (lambda line: log.error("%s", line)))
    on_loss = _release_on_loss(transport, leave) if ps.rank == 0 else leave
    peers = [(TRAINER, r) for r in range(1, ps.world_size)] if ps.rank == 0 else []
    hb = Heartbeat(control, transport.heartbeat, me, watch=peers, on_loss=on_loss,
                   store_is_peer=None if ps.rank == 0 else (TRAINER, 0)).start()
    hub = (SampleHub(store, control, transport.channel, topology, ps.dp_rank, device=ps.device)
           if ps.is_hub else None)
    leader = ps.tp_rank == 0 and ps.dp_rank == 0
    if not leader:
        return TrainerEndpoints(store, hb, hub, None, me, bound)
    ws = transport.weight_sync
    background = ws.background and ps.pp_size == 1 and 2 * stage_bytes <= ws.background_max_bytes
    if ps.rank == 0:
        why = ("" if background else " (weight_sync.background off)" if not ws.background else
               " (several PP stages)" if ps.pp_size > 1 else
               f" (two staged copies of {stage_bytes / 2**30:.1f} GiB exceed weight_sync.background_max_bytes)")
        log.info("weight sync: %s%s", "staged, published from a thread" if background else "blocking", why)
    # the thread polls the store on a connection of its own
    sender_store = connect_store(control, who=f"trainer {ps.rank} weight sync") if background else store
    sender = WeightSender(sender_store, control, ws, topology, ps.pp_rank, hb, device=ps.device)
    publisher = BackgroundPublisher(sender, ps.device) if background else None
    return TrainerEndpoints(store, hb, hub, sender, me, bound, publisher)


@dataclass
class Backlog:
    """Groups the hubs received beyond B per step so far: they count for the next steps, so the
    loop makes one step per B groups received on average and never waits for new groups while B
    untrained ones sit in the buffer (two workers finishing a batch each at once). With
    ``replay.fill_batch`` only trainable groups count: degenerate ones never enter the buffer.
    ``ahead`` (``loop.wait_for_bound``: eta) makes a step wait until the backlog holds
    ``(ahead + 1) * B``: at step t, ``(t + eta + 1) * B`` received in all, every start the bound
    allows under version t (``surplus`` restored on resume is received - t * B, the same count)."""

    per_step: int  # B
    surplus: int = 0  # groups received beyond ``per_step`` per step so far
    ahead: int = 0  # steps of groups beyond this one's B a step waits for (wait_for_bound: eta)

    def need(self) -> int:
        """New groups the next step must wait for."""
        return max(0, StalenessBound(self.ahead, self.per_step).window - self.surplus)

    def floor(self) -> int:
        """New groups the next step needs for its B, the bound aside."""
        return max(0, self.per_step - self.surplus)

    def took(self, received: int) -> None:
        """A step started with ``received`` new groups."""
        self.surplus = max(0, self.surplus + received - self.per_step)

    def keep_at_most(self, untrained: int) -> None:
        """The buffers hold only ``untrained`` trainable groups never trained (after eviction): a
        surplus group that left the window untrained (a freshest-first rule passed it over until
        it aged out) or arrived already out of it is no group for the next step, which would
        otherwise wait for too few and train fewer than B. Not with ``ahead``: there the surplus
        counts starts against the bound, and a start is not given back when its group expires."""
        if not self.ahead:
            self.surplus = min(self.surplus, max(0, untrained))


@dataclass
class Received:
    """One step's outcome of receiving; ``groups`` on the hub rank only."""

    groups: list[SampleGroup] = field(default_factory=list)  # this replica's new groups (hub)
    total: int = 0  # groups the hubs received together (hub ranks)
    degenerate: list[SampleGroup] = field(default_factory=list)  # fill_batch: this replica's dropped ones
    short: bool = False  # fill_batch: the step goes on with fewer than it waited for (the guard)
    stopped: bool = False  # a signal cut the wait: checkpoint without this step
    fatal: str = ""  # the trainer must give up: why, naming each worker's state


class ProgressWatch:
    """Rank 0's watch on the rollout side while a step waits for groups.

    Gives up, with one line naming every worker, when no group arrived for ``timeout_s`` or
    every worker is gone (exited, or lost by heartbeat); one that has not joined yet may still
    be starting, so it only counts against the timeout.
    """

    def __init__(self, ep: TrainerEndpoints, num_workers: int, timeout_s: float, step: int, need: int,
                 bound: bool = False) -> None:
        self.ep, self.num_workers, self.timeout_s, self.step, self.need = ep, num_workers, timeout_s, step, need
        self.bound = bound  # loop.wait_for_bound: ``need`` fills the staleness bound
        self._arrived = 0

    def check(self, total: int, degenerate: int = 0) -> str:
        """"" while the run can go on, else why it cannot (after ``total`` groups of ``need``, and
        ``degenerate`` more dropped on arrival under ``replay.fill_batch``).

        Idle time counts from the last group of any step (``ep.last_group_at``), a dropped one
        included (the rollout side is alive): a weight sync that waited for a stuck worker is part of it.
        """
        now = time.monotonic()
        if total + degenerate > self._arrived:
            self._arrived, self.ep.last_group_at = total + degenerate, now
        idle = now - self.ep.last_group_at
        gone = [w for w in range(self.num_workers) if self._gone(w)]
        where = f"trainer step {self.step}: {total}/{self.need} groups"
        if self.bound:
            where += " (loop.wait_for_bound: every start the staleness bound allows)"
        if degenerate:  # groups did arrive: the task, not the rollout side, may be the cause
            where += (f" ({degenerate} arrived, all degenerate: equal rewards, dropped by replay.fill_batch)"
                      if not total else f" and {degenerate} degenerate ones dropped (replay.fill_batch)")
        if len(gone) == self.num_workers:
            return f"{where}; every rollout worker is gone: {self.states()}"
        if idle > self.timeout_s:
            return (f"{where}; no new group for {idle:.0f} s (loop.receive_timeout_s={self.timeout_s:g}): "
                    f"{self.states()}")
        return ""

    def _gone(self, worker: int) -> bool:
        """Exited or lost, and not being started again.

        The restart is read first: the heartbeat thread takes a new process's first beat in one
        step (one more incarnation, no longer lost), so a loss read before that beat and a restart
        read after it would call a worker gone whose new process just beat.
        """
        if self._restarting(worker):
            return False
        hb, store = self.ep.heartbeat, self.ep.store
        return hb.is_lost(WORKER, worker) or store.check([Keys.exited(WORKER, worker)])

    def _restarting(self, worker: int) -> int:
        """The launcher's restart number of ``worker`` when its new process has not beaten yet, else 0."""
        restarts = get_int(self.ep.store, Keys.restarts(WORKER, worker), 0)
        return restarts if restarts >= self.ep.heartbeat.incarnations(WORKER, worker) else 0

    def states(self) -> str:
        """Each worker by name with its liveness and the weights it holds."""
        store, hb, parts = self.ep.store, self.ep.heartbeat, []
        published = published_version(store)
        for w in range(self.num_workers):
            if self._restarting(w) and not hb.is_alive(WORKER, w):
                state = f"restarting (restart {self._restarting(w)}, not beating yet)"
            elif store.check([Keys.exited(WORKER, w)]):
                state = f"exited (code {store.get(Keys.exited(WORKER, w)).decode()})"
            elif hb.is_lost(WORKER, w):
                state = "lost (no heartbeat)"
            elif hb.is_alive(WORKER, w):
                state = "alive but sending nothing"
            else:
                state = "never joined"
            ack = get_int(store, SyncKeys.ack(w), 0)
            parts.append(f"{describe_peer(store, WORKER, w)}: {state}, weights v{ack} (published v{published})")
        return "; ".join(parts)


def receive_groups(ep: TrainerEndpoints, ps, need: int, timeout_s: float, step: int, poll_s: float,
                   num_workers: int, stop: Callable[[], bool] = lambda: False,
                   idle: Callable[[list[SampleGroup]], bool] = lambda groups: False,
                   max_degenerate: int | None = None, filled: Callable[[], bool] | None = None,
                   floor: int = 0) -> Received:
    """This replica's new groups once the hubs together hold ``need`` (hub ranks only: the
    replica's other ranks learn the outcome from the hub, ``StepRunner.follow_wait``).

    Hubs poll their shard and sum the counts over DP until ``need`` arrived (a hub never waits for
    its "share": the round-robin split, ``samples.shard_of``, is even only up to one group per
    worker). With ``filled`` (``loop.wait_for_bound``) the wait also ends once ``floor`` arrived and
    rank 0's ``filled()`` said nothing more can start or arrive under the bound
    (``staleness.bound_filled``): a batch engine may not reach ``need`` exactly. The ledger counts a
    group delivered a moment before its hub's ``poll`` can return it, and the other hubs' polls
    are not ordered with rank 0's ask, so the verdict is asked after a poll, carried by that poll's
    sum and acted on after the next one: every hub polled after it was asked, each while settled
    (``SampleHub.settled``), and no hub gave a start back in either poll (room again). A verdict
    acted on in the poll it was asked for could count a group that poll missed, and the step would
    end short of it: which groups a step trains would hang on a race. This is where groups enter
    the trainer: a
    group more than ``max_staleness`` versions behind the weights the step trains (version
    ``step``: version v is the weights after v steps) is refused here and counted, its start given
    back (``staleness.admit_fresh``), so no step trains a group over the bound, whatever the
    workers did. With ``max_degenerate`` (``replay.fill_batch``) a group whose rewards are all
    equal is dropped here too, its start given back (``staleness.give_back_degenerate``), and only
    the others count toward ``need``; once the hubs dropped ``max_degenerate`` in this wait, the
    step goes on with what it has (``short``: a task the policy cannot learn never blocks the
    run). Between polls a hub calls ``idle(groups so
    far)`` and sleeps ``poll_s`` only when it returns False: the trainer computes the rows the
    step will need while it waits (``step/prefetch.py``), one short pass per call. Every hub
    leaves with ``stopped`` when any hub's ``stop()`` turned true while waiting (a signal), and
    with ``fatal`` when rank 0's ``ProgressWatch`` gave up (the other hubs get a stand-in line:
    rank 0 holds the reason and the loop's stop agreement spreads it); the groups of a cut wait
    are not kept.
    """
    assert ep.hub is not None, "only a replica's hub receives groups"
    out = Received()
    watch = ProgressWatch(ep, num_workers, timeout_s, step, need, bound=filled is not None) if ps.rank == 0 else None
    verdict, judged = "", False  # judged: the ledger was filled before every hub's last poll
    while True:
        settled = filled is None or ep.hub.settled()  # before the poll: what the ledger counted is in it
        polled = [r.group for r in ep.hub.poll()]
        fresh = admit_fresh(ep.store, polled, step, ep.bound.max_staleness,
                            who=f"hub {ep.hub.hub}, trainer step {step}")
        if max_degenerate is not None:
            equal = [rewards_equal(g.rewards) for g in fresh]
            dead = [g for g, e in zip(fresh, equal) if e]
            give_back_degenerate(ep.store, dead)
            out.degenerate += dead
            fresh = [g for g, e in zip(fresh, equal) if not e]
        out.groups += fresh
        full = int(filled is not None and ps.rank == 0 and filled())  # acted on after the next poll
        counts = ps.dp_sum(torch.tensor([len(out.groups), int(stop()), int(bool(verdict)), len(out.degenerate),
                                         full, len(polled) - len(fresh), int(not settled)], dtype=torch.int64))
        total, dropped, gave_back = int(counts[0]), int(counts[3]), bool(counts[5])
        if watch is not None:
            verdict = verdict or watch.check(total, dropped)  # sent with the next sum: hubs leave together
        if int(counts[1]):
            return Received(stopped=True)
        if total >= need or (judged and not gave_back and not int(counts[6]) and total >= floor):
            out.total = total
            return out
        judged = bool(counts[4]) and not gave_back  # a give-back in this poll may be after the verdict
        if max_degenerate is not None and dropped >= max_degenerate:
            if ps.rank == 0:
                log.warning("trainer step %d: %d degenerate groups dropped (equal rewards) and %d of %d trainable "
                            "arrived: training with those (replay.fill_max_degenerate=%d; the task may be too "
                            "hard or too easy for the policy)", step, dropped, total, need, max_degenerate)
            out.total, out.short = total, True
            return out
        if int(counts[2]):
            return Received(fatal=verdict or f"trainer step {step}: trainer rank 0 gave up waiting for groups")
        if not idle(out.groups):
            time.sleep(poll_s)


def wait_for_workers(ep: TrainerEndpoints, ps, num_workers: int, timeout_s: float, tag: int = 0) -> None:
    """Rank 0 waits until every rollout worker beats (so a publish reaches them), then all
    trainer ranks go on: used before re-publishing resumed weights to fresh workers.

    The other ranks wait on a store key rank 0 sets (with a margin over ``timeout_s``), not on a
    process-group barrier, whose own timeout could fire first while rank 0 is still waiting.
    """
    key = f"loop/workers_ready/{tag}"
    if ps.rank == 0:
        deadline = time.monotonic() + timeout_s
        while not all(ep.heartbeat.is_alive(WORKER, w) for w in range(num_workers)):
            if time.monotonic() > deadline:
                missing = [w for w in range(num_workers) if not ep.heartbeat.is_alive(WORKER, w)]
                log.warning("rollout workers %s not up after %.0f s; publishing anyway", missing, timeout_s)
                break
            ep.heartbeat.refresh(ep.store)
            time.sleep(0.05)
        ep.store.set(key, "1")
    else:
        wait_key(ep.store, key, timeout_s + 60.0, "trainer rank 0 to see the rollout workers")


def publish_weights(ep: TrainerEndpoints, trainer, ps) -> SyncReport | None:
    """Export this stage's HF tensors (a TP collective) and send them; the report (stage leaders).

    Raises what ``WeightSender.publish`` raises (``WeightSyncFailed``, ``TransportTimeout``) on
    the stage leader only; the loop makes every rank agree on it before stopping.
    """
    if ps.dp_rank != 0:
        return None
    named = trainer.export_hf_stage()
    if ep.sender is None:  # other TP ranks of the stage: take part in the export's gathers
        for _ in named:
            pass
        return None
    if ep.publisher is not None:  # stage now; the report is of the last sync that finished
        return ep.publisher.submit(trainer.version, named)
    try:
        report = ep.sender.publish(trainer.version, named)
    finally:
        # The sender stops reading early when no worker joined or the sync failed; the export
        # is a TP collective, so run it to the end or the other TP ranks hang in a gather.
        for _ in named:
            pass
    if report.missing:
        log.warning("weight sync v%d: missing %s", trainer.version, report.missing)
    return report
