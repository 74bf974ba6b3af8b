"""The rollout worker: prompts in, sampled groups out to the trainer hubs, weights in between.

One process per engine (a Slurm job step of its own). It drives its engine through the streaming
contract (``engines.base.StreamingEngine``; a batch engine such as ``hf`` is wrapped by
``engines.stream.BatchStream``), so ``hf`` and ``vllm`` share this one loop:

    safe point: stop flag? weight sync offered? (pause, load, ack, resume)
    admit: while fewer than ``max_inflight`` groups are in flight, reserve a start against the
           staleness bound (global store counter) and submit the next prompt group
    poll: take the groups whose n responses are done (a batch engine generates here), hand
          their rewards to a thread pool (off the engine's critical path); post finished groups

A group is handed to the sample channel the moment it finishes, whatever the others in flight are
doing; the channel's own thread per hub sends it (``transport.channel``: over a data-plane pair
group, the store carrying only its header), so the loop waits only on back-pressure. At a weight
sync, ``update_mode`` decides what happens to groups in flight: ``finish`` stops admitting, lets
them complete on the old weights (a sample's tokens keep one version), then loads; ``interrupt``
loads at once and they continue on the new weights, every token tagged with the version that
produced it (``Sample.token_versions``; docs/architecture.md, Versions and staleness). In ``finish``
mode the trainer's sender waits for the drain: ``transport.weight_sync.join_timeout_s`` must exceed
the longest generation, or the worker misses that sync (it is named, and catches up at the next).

The behavior log-probs are the engine's own and are never recomputed. If the trainer goes away
(store unreachable or trainer rank 0 silent for the heartbeat timeout) the worker exits with
``ExitCode.TRAINER_LOST`` at once: nothing it holds is worth saving. If its engine cannot load the
weights the trainer sends, it says why and exits with ``ExitCode.LOAD_FAILED`` (``exit_reason``).

A process started again with the same worker id (restarted) takes its predecessor's place: it
joins as a new generation, which gives back the staleness reservations of the groups that died
with it (they are dropped and counted), continues its group ids after every one the predecessor
started (``Keys.groups_made``, kept current as groups start; read by ``loop.rollout_loop``), and
takes the current weights at its first weight sync. A process the trainer declared lost while it
was only frozen finds its generation fenced at its next reservation: the groups it still holds
are refused at the hub, and it goes on as a new generation (``transport.staleness``).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_darl import timeline
from megatron_darl.rollout.config import RolloutWorkerConfig, SamplingConfig
from megatron_darl.rollout.engines.base import Engine, Generation, StreamingEngine
from megatron_darl.rollout.engines.stream import as_stream
from megatron_darl.rollout.prompts import PromptRecord, PromptSource
from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.transport import (
    TRAINER, WORKER, Heartbeat, MemberInfo, PeerLoss, SampleSender, StalenessBound, StalenessGate, StartTicket,
    Topology, TransportConfig, TransportTimeout, WeightLoadError, WeightReceiver, connect_store, post_exit, register,
    stop_requested,
)
from megatron_darl.exit_codes import ExitCode
from megatron_darl.transport.cuda_ipc import device_uuid
from megatron_darl.transport.store import Keys

log = logging.getLogger(__name__)
RewardFn = Callable[[Any, str], float]


@dataclass
class _Pending:
    """A generated group whose rewards are being computed."""

    group: SampleGroup  # samples with reward 0.0 until the future is done
    ticket: StartTicket  # staleness reservation it was started under
    rewards: Future  # -> list[float], one per sample


def fair_share(limit: int, bound: StalenessBound, num_workers: int) -> int:
    """A worker's groups in flight: ``limit``, but at most its share of the groups the staleness
    bound lets start at once, ``ceil((eta + 1) * B / workers)``; so every worker can fill its batch
    (synchronous with two workers: B/2 each, not B for one and nothing for the other)."""
    share = -(-bound.window // num_workers)
    return max(1, min(limit, share))


def channel_device(engine_device) -> torch.device:
    """Where sample payloads leave from: the engine's GPU, else this process's (a vLLM engine runs
    in processes of its own on the GPUs this one sees), else the CPU (a gloo pair)."""
    if isinstance(engine_device, torch.device) and engine_device.type == "cuda":
        return engine_device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RolloutWorker:
    """Run generation for the trainer until it asks to stop (or goes away).

    Args:
        bound: the staleness bound (eta, B) starts are reserved against (``RunConfig.bound``).
        topology: the run's workers, hubs and stages (``RunConfig.topology``).
        decode: token ids -> response text for ``reward_fn`` (the tokenizer's decode).
        on_version: called with each version the engine loads, at a safe point (generation resumed).
        reward_fn: ``reward_fn(record, response_text) -> float``; any callable.
    """

    def __init__(
        self, cfg: RolloutWorkerConfig, transport: TransportConfig, bound: StalenessBound, topology: Topology,
        engine: Engine | StreamingEngine,
        prompts: PromptSource, sampling: SamplingConfig, reward_fn: RewardFn,
        decode: Callable[[list[int]], str], on_version: Callable[[int], None] | None = None,
    ) -> None:
        if cfg.worker_id >= topology.workers:
            raise ValueError(f"RolloutWorkerConfig.worker_id {cfg.worker_id} >= the run's {topology.workers} "
                             "rollout workers (cluster.rollout_workers)")
        self.cfg, self.transport, self.engine, self.prompts = cfg, transport, engine, prompts
        self.bound, self.topology = bound, topology
        self.sampling, self.reward_fn, self.decode = sampling, reward_fn, decode
        self.on_version = on_version  # called at a safe point with each version the engine loads
        self.me = MemberInfo.here(WORKER, cfg.worker_id)
        self.groups_made = 0  # local group counter (folded into group ids)
        self.groups_sent = 0  # groups posted to hubs by this process
        self.weights_version = cfg.initial_version  # version the engine holds (-1: none valid)
        self.exit_reason = ""  # one line on why ``run`` returned non-zero
        self.engine_seconds = 0.0  # wall seconds polling the engine while it had work
        self.engine_calls = 0  # polls of the engine while it had work (a batch engine: generate calls)
        self.groups_finished = 0  # groups the engine returned
        self.sync_seconds = 0.0  # wall seconds in weight syncs (pause, receive, load, resume)
        self.idle_seconds = {"gate": 0.0, "weights": 0.0}  # engine empty: the bound refused, or no valid weights
        # the loop's own wall seconds outside the engine poll (the engine keeps generating meanwhile,
        # until its requests run out): sending groups (back-pressure included), admitting new ones
        # (ledger requests), and turning finished ones into groups (decode, tensors)
        self.host_seconds = {"flush": 0.0, "admit": 0.0, "collect": 0.0}
        self._blocked = ""  # why the last admission added nothing ("gate", "weights" or "")
        self.batch_limit = fair_share(cfg.inflight_limit, bound, topology.workers)
        if self.batch_limit < cfg.inflight_limit:
            log.info("rollout %d: %d groups in flight at most (its share of the %d the staleness bound "
                     "lets %d workers start at once), not %d", cfg.worker_id, self.batch_limit,
                     bound.window, topology.workers,
                     cfg.inflight_limit)
        # group id -> its start, prompt and ordinal among this worker's groups, while in flight
        self._started: dict[int, tuple[StartTicket, PromptRecord, int]] = {}
        self._ready: list[_Pending] = []  # finished groups not yet handed to the sender

    def state_dict(self) -> dict[str, Any]:
        """Resumable position: prompt source and group counter."""
        return {"prompts": self.prompts.state_dict(), "groups_made": self.groups_made}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.groups_made = int(state["groups_made"])

    def run(self) -> int:
        """Serve until the stop flag (returns ``ExitCode.OK``); exits the process if the trainer is lost."""
        control = self.transport.control
        store = connect_store(control, who=self.me.describe())
        register(store, self.me)
        hb = Heartbeat(control, self.transport.heartbeat, self.me, watch=[(TRAINER, 0)],
                       on_loss=self._trainer_lost, store_is_peer=(TRAINER, 0), stats=self.stats).start()
        pool = ThreadPoolExecutor(self.cfg.reward_threads, thread_name_prefix=f"reward-{self.cfg.worker_id}")
        code = ExitCode.TRAINER_LOST
        try:
            code = self._serve(store, hb, pool)
            return code
        except TransportTimeout:
            self._await_trainer_verdict(hb)
            raise
        except WeightLoadError as exc:
            self.exit_reason = str(exc)
            log.error("%s; exiting %d", exc, ExitCode.LOAD_FAILED)
            code = ExitCode.LOAD_FAILED
            return code
        except (RuntimeError, dist.DistError, ConnectionError) as exc:
            self.exit_reason = f"{self.me.describe()}: control-plane store failed (trainer gone?): {exc}"
            log.error("%s", self.exit_reason)
            return ExitCode.TRAINER_LOST
        finally:
            hb.close()
            pool.shutdown(wait=False, cancel_futures=True)
            if code != ExitCode.TRAINER_LOST:  # the trainer need not wait for us (best effort)
                post_exit(store, self.me, code)

    def stats(self) -> dict[str, float]:
        """Cumulative statistics for the trainer's per-worker metrics (sent with each heartbeat)."""
        return {"engine_seconds": self.engine_seconds, "engine_calls": self.engine_calls,
                "groups_finished": self.groups_finished, "sync_seconds": self.sync_seconds,
                **{f"idle_{why}_seconds": s for why, s in self.idle_seconds.items()},
                **{f"{part}_seconds": s for part, s in self.host_seconds.items()}}

    def _await_trainer_verdict(self, hb: Heartbeat) -> None:
        """A store or ledger request timed out or its connection broke. When the trainer is going
        away (killed, or at its end), its heartbeat verdict follows within the timeout and ends this
        process with ``ExitCode.TRAINER_LOST`` (``_trainer_lost``); wait for it, so a worker that lost
        the race between its own request and the verdict exits as a trainer loss, not as a crash.
        A trainer still beating after that is a real failure: the caller re-raises."""
        cfg = self.transport.heartbeat
        deadline = time.monotonic() + cfg.timeout_s + 2 * cfg.interval_s
        log.warning("%s: a request to trainer rank 0 failed; waiting up to %.0f s for its heartbeat verdict",
                    self.me.describe(), deadline - time.monotonic())
        while time.monotonic() < deadline and not hb.is_lost(TRAINER, 0):
            time.sleep(min(cfg.interval_s, 0.1))

    def _trainer_lost(self, loss: PeerLoss) -> None:
        log.error("%s: %s is lost (silent %.1f s); exiting %d", self.me.describe(), loss.peer,
                  loss.silent_s, ExitCode.TRAINER_LOST)
        os._exit(ExitCode.TRAINER_LOST)

    def _serve(self, store: dist.Store, hb: Heartbeat, pool: ThreadPoolExecutor) -> int:
        # joining as a new generation fences a predecessor's and gives back its starts in flight
        gate = StalenessGate(store, self.bound, worker_id=self.cfg.worker_id)
        if gate.dropped:
            log.warning("%s: the previous process of rollout %d died with %d groups in flight: dropped, "
                        "their staleness reservations given back", self.me.describe(), self.cfg.worker_id,
                        gate.dropped)
        engine_device = getattr(self.engine, "device", None)  # a worker on its leader's GPU gets CUDA IPC
        sender = SampleSender(store, self.transport.control, self.transport.channel, self.topology, self.cfg.worker_id,
                              gate=gate, device=channel_device(engine_device))
        receiver = WeightReceiver(store, self.transport.control, self.transport.weight_sync, self.topology, self.cfg.worker_id,
                                  self.engine.load_weights, initial_version=self.cfg.initial_version,
                                  gpu=device_uuid(engine_device) if isinstance(engine_device, torch.device) else None)
        stream = as_stream(self.engine, self.cfg.chunk_tokens)
        stream.resume(receiver.version)
        self._loaded(receiver.version)
        pending: list[_Pending] = []

        def safe_point() -> None:
            self._collect(stream, pool, 0.0)
            self._sync_if_offered(stream, receiver, hb)

        post_counters = partial(hb.post_counters, store)  # before a send: see Heartbeat.post_counters

        # A batch engine blocks for a whole batch in the next poll: a group whose rewards are not
        # done yet would reach the trainer a batch late, so its rewards are awaited first.
        whole_batches = getattr(stream, "whole_batches", False)
        while not stop_requested(store):
            start = time.monotonic()
            pending = self._flush(sender, pending + self._take_ready(), safe_point,
                                  lambda: stop_requested(store), whole_batches, post_counters)
            self.host_seconds["flush"] += time.monotonic() - start
            safe_point()
            start = time.monotonic()
            admitted = self._admit(gate, stream, receiver)
            self.host_seconds["admit"] += time.monotonic() - start
            if admitted:  # where a restarted process continues its group ids
                store.set(Keys.groups_made(self.cfg.worker_id), str(self.groups_made))
            got = self._collect(stream, pool, self.cfg.idle_sleep_s if stream.inflight() else 0.0)
            if not admitted and not got and not stream.inflight():
                time.sleep(self.cfg.idle_sleep_s)
                if self._blocked:
                    self.idle_seconds[self._blocked] += self.cfg.idle_sleep_s
        # Drain what was generated, but only while the hub still takes groups: a trainer that
        # stopped receiving would leave us waiting on back-pressure until the store closes, so
        # give up after half the heartbeat timeout (the trainer waits a full one for our exit).
        # Unsent groups are not lost: a resumed run restarts this worker's prompts after the
        # groups the trainer checkpointed as received (loop/resume.py). Groups still generating
        # are dropped with the engine.
        deadline = time.monotonic() + self.transport.heartbeat.timeout_s / 2
        before = self.groups_sent
        left = self._flush(sender, pending + self._take_ready(), safe_point,
                           lambda: time.monotonic() > deadline, True, post_counters)
        unacked = sender.flush(max(0.0, deadline - time.monotonic()))
        sender.close()
        log.info("%s: stop flag seen; drained %d groups (%d sent in all, %d not acked), %d left unsent, "
                 "%d still generating", self.me.describe(), self.groups_sent - before, self.groups_sent,
                 unacked, len(left), stream.inflight())
        return ExitCode.OK

    def _sync_if_offered(self, stream: StreamingEngine, receiver: WeightReceiver, hb: Heartbeat) -> None:
        """Take part in an offered weight sync at this safe point, as ``update_mode`` says.

        ``finish``: only once no group is in flight (admission is closed meanwhile, see
        ``_admit``). ``interrupt``: at once; the engine stops in-flight responses where they are
        and continues them on the new weights after ``resume``. An exception from loading
        propagates: the engine's weights are then unknown and the worker must not generate.
        """
        if receiver.pending() is None:
            return
        interrupt = self.cfg.update_mode == "interrupt"
        if not interrupt and stream.inflight():
            return
        start = time.monotonic()
        stream.pause(interrupt)
        hb.step = receiver.maybe_sync() or hb.step
        stream.resume(receiver.version)
        if self.weights_version < 0 <= receiver.version:  # a resumed run's first weights
            timeline.mark("first_weights")
        changed = receiver.version != self.weights_version
        self.weights_version = receiver.version
        self.sync_seconds += time.monotonic() - start
        if changed:
            self._loaded(receiver.version)

    def _loaded(self, version: int) -> None:
        """The engine holds ``version`` (resumed, at a safe point): the ``on_version`` hook's turn
        (the held-out evaluation of ``loop.heldout_eval``: engine calls outside the stream, never
        samples, staleness reservations or groups)."""
        if self.on_version is not None and version >= 0:
            self.on_version(version)

    def _admit(self, gate: StalenessGate, stream: StreamingEngine, receiver: WeightReceiver) -> int:
        """Submit groups while fewer than ``batch_limit`` are in flight and the bound allows; a
        batch engine takes a whole batch at once or waits (one batch size, one compilation)."""
        self._blocked = "weights"
        if self.cfg.update_mode == "finish" and receiver.pending() is not None:
            return 0  # draining for a weight sync
        if not receiver.can_generate():
            return 0
        self._blocked = ""
        if getattr(stream, "whole_batches", False):
            tickets = [] if stream.inflight() else gate.try_start_batch(self.batch_limit)
        else:
            tickets = []
            while stream.inflight() + len(tickets) < self.batch_limit:
                ticket = gate.try_start()
                if ticket is None:
                    break
                tickets.append(ticket)
        if not tickets and not stream.inflight():
            self._blocked = "gate"
        for ticket in tickets:
            record = self.prompts.next()
            group_id = self.groups_made * self.topology.workers + self.cfg.worker_id
            self._started[group_id] = (ticket, record, self.groups_made)
            self.groups_made += 1
            stream.submit(group_id, list(record.token_ids), self.sampling)
        return len(tickets)

    def _collect(self, stream: StreamingEngine, pool: ThreadPoolExecutor, timeout_s: float) -> int:
        """Finished groups of the engine -> rewards in the pool, groups into ``_ready``."""
        busy, start = stream.inflight() > 0, time.monotonic()
        finished = stream.poll(timeout_s)
        if busy:
            self.engine_seconds += time.monotonic() - start
            self.engine_calls += 1
        self.groups_finished += len(finished)
        start = time.monotonic()
        for done in finished:
            ticket, record, index = self._started.pop(done.key)
            group = self._group(done.key, index, record, done.generations)
            texts = [self.decode(g.token_ids.tolist()) for g in done.generations]
            self._ready.append(_Pending(group, ticket, pool.submit(self._rewards, record.record, texts)))
        self.host_seconds["collect"] += time.monotonic() - start
        return len(finished)

    def _take_ready(self) -> list[_Pending]:
        ready, self._ready = self._ready, []
        return ready

    def _rewards(self, record: Any, texts: list[str]) -> list[float]:
        return [float(self.reward_fn(record, text)) for text in texts]

    def _group(self, group_id: int, index: int, record: PromptRecord, gens: list[Generation]) -> SampleGroup:
        prompt = torch.tensor(record.token_ids, dtype=torch.int64)
        samples = []
        for i, g in enumerate(gens):
            versions = g.token_versions
            if versions is None:
                versions = torch.full_like(g.token_ids, self.weights_version, dtype=torch.int64)
            samples.append(Sample(
                sample_id=group_id * len(gens) + i, prompt_ids=prompt, response_ids=g.token_ids.to(torch.int64),
                behavior_logprobs=g.logprobs.to(torch.float32), token_versions=versions.to(torch.int64),
                truncated=g.finish_reason == "length"))
        return SampleGroup(group_id=group_id, prompt_id=record.prompt_id, samples=samples,
                           worker_id=self.cfg.worker_id, worker_index=index)

    def _flush(self, sender: SampleSender, pending: list[_Pending], safe_point: Callable[[], None],
               stopped: Callable[[], bool], wait: bool, post_counters: Callable[[], None]) -> list[_Pending]:
        """Hand finished groups to the channel (the one that reaches the hub ends its staleness
        reservation: ``SampleSender``); returns those not handed over. The reward errors counted
        while scoring them are posted first, so the trainer's metrics of the step that trains on
        them include them (``Heartbeat.post_counters``)."""
        left = []
        for i, p in enumerate(pending):
            if not wait and not p.rewards.done():
                left.append(p)
                continue
            for sample, reward in zip(p.group.samples, p.rewards.result()):
                sample.reward = reward
            post_counters()
            if sender.send(p.group, p.ticket, while_waiting=safe_point, stopped=stopped) is None:
                return left + pending[i:]  # stop flag raised while blocked: leave unsent
            self.groups_sent += 1
            if self.groups_sent == 1:
                timeline.mark("first_group")
        return left
