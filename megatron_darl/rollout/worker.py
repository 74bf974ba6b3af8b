"""The rollout worker: prompts in, sampled groups out to the trainer hubs, weights in between.

One process per engine (a Slurm job step of its own). Its loop, with a safe point between
engine calls:

    safe point: stop flag? weight sync offered? (load, ack)  -> engine holds >= published version?
    reserve group starts against the staleness bound (global store counter)
    generate a batch of groups (every token tagged with the engine's version)
    hand rewards to a thread pool (off the engine's critical path); post finished groups

The behavior log-probs are the engine's own and are never recomputed. If the trainer goes away
(store unreachable or trainer rank 0 silent for the heartbeat timeout) the worker exits with
``EXIT_TRAINER_LOST`` at once: nothing it holds is worth saving. If its engine cannot load the
weights the trainer sends, it says why and exits with ``EXIT_LOAD_FAILED`` (``exit_reason``).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_darl.rollout.engines.base import Engine, Generation, SamplingConfig
from megatron_darl.rollout.prompts import PromptRecord, PromptSource
from megatron_darl.samples import Sample, SampleGroup
from megatron_darl.transport import (
    TRAINER, WORKER, Heartbeat, MemberInfo, PeerLoss, SampleSender, StalenessGate, StartTicket,
    TransportConfig, TransportTimeout, WeightLoadError, WeightReceiver, connect_store, post_exit, register,
    stop_requested,
)
from megatron_darl.transport.cuda_ipc import device_uuid
from megatron_darl.transport.store import Keys

log = logging.getLogger(__name__)
EXIT_OK = 0
EXIT_TRAINER_LOST = 3  # the trainer (store host) is gone or silent
EXIT_LOAD_FAILED = 4  # the engine could not load the weights the trainer sent
RewardFn = Callable[[Any, str], float]


@dataclass
class RolloutWorkerConfig:
    """One rollout worker."""

    worker_id: int = 0  # rank among rollout workers (0..num_workers-1)
    groups_per_batch: int = 8  # prompt groups generated in one engine call (n sequences each)
    reward_threads: int = 4  # threads computing rewards off the engine's critical path
    idle_sleep_s: float = 0.01  # sleep when the staleness bound or a sync blocks generation
    initial_version: int = 0  # version of the engine's starting weights (-1: wait for a sync)

    def __post_init__(self) -> None:
        if self.worker_id < 0:
            raise ValueError(f"RolloutWorkerConfig.worker_id must be >= 0, got {self.worker_id}")
        if self.groups_per_batch < 1 or self.reward_threads < 1:
            raise ValueError("RolloutWorkerConfig.groups_per_batch and reward_threads must be >= 1")


@dataclass
class _Pending:
    """A generated group whose rewards are being computed."""

    group: SampleGroup  # samples with reward 0.0 until the future is done
    ticket: StartTicket  # staleness reservation it was started under
    rewards: Future  # -> list[float], one per sample


class RolloutWorker:
    """Run generation for the trainer until it asks to stop (or goes away).

    Args:
        decode: token ids -> response text for ``reward_fn`` (the tokenizer's decode).
        reward_fn: ``reward_fn(record, response_text) -> float``; any callable.
    """

    def __init__(
        self, cfg: RolloutWorkerConfig, transport: TransportConfig, engine: Engine,
        prompts: PromptSource, sampling: SamplingConfig, reward_fn: RewardFn,
        decode: Callable[[list[int]], str],
    ) -> None:
        if cfg.worker_id >= transport.control.num_workers:
            raise ValueError(
                f"RolloutWorkerConfig.worker_id {cfg.worker_id} >= control.num_workers {transport.control.num_workers}"
            )
        self.cfg, self.transport, self.engine, self.prompts = cfg, transport, engine, prompts
        self.sampling, self.reward_fn, self.decode = sampling, reward_fn, decode
        self.me = MemberInfo.here(WORKER, cfg.worker_id)
        self.groups_made = 0  # local group counter (folded into group ids)
        self.groups_sent = 0  # groups posted to hubs by this process
        self.weights_version = cfg.initial_version  # version the engine holds (-1: none valid)
        self.exit_reason = ""  # one line on why ``run`` returned non-zero
        self.engine_seconds = 0.0  # wall seconds inside ``engine.generate`` (posted for the trainer)

    def state_dict(self) -> dict[str, Any]:
        """Resumable position: prompt source and group counter."""
        return {"prompts": self.prompts.state_dict(), "groups_made": self.groups_made}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.groups_made = int(state["groups_made"])

    def run(self) -> int:
        """Serve until the stop flag (returns ``EXIT_OK``); exits the process if the trainer is lost."""
        control = self.transport.control
        store = connect_store(control, who=self.me.describe())
        register(store, self.me)
        hb = Heartbeat(control, self.transport.heartbeat, self.me, watch=[(TRAINER, 0)],
                       on_loss=self._trainer_lost, store_is_peer=(TRAINER, 0)).start()
        pool = ThreadPoolExecutor(self.cfg.reward_threads, thread_name_prefix=f"reward-{self.cfg.worker_id}")
        code = EXIT_TRAINER_LOST
        try:
            code = self._serve(store, hb, pool)
            return code
        except WeightLoadError as exc:
            self.exit_reason = str(exc)
            log.error("%s; exiting %d", exc, EXIT_LOAD_FAILED)
            code = EXIT_LOAD_FAILED
            return code
        except (RuntimeError, dist.DistError, ConnectionError) as exc:
            if isinstance(exc, TransportTimeout):
                raise
            self.exit_reason = f"{self.me.describe()}: control-plane store failed (trainer gone?): {exc}"
            log.error("%s", self.exit_reason)
            return EXIT_TRAINER_LOST
        finally:
            hb.close()
            pool.shutdown(wait=False, cancel_futures=True)
            if code != EXIT_TRAINER_LOST:  # the trainer need not wait for us (best effort)
                post_exit(store, self.me, code)

    def _trainer_lost(self, loss: PeerLoss) -> None:
        log.error("%s: %s is lost (silent %.1f s); exiting %d", self.me.describe(), loss.peer,
                  loss.silent_s, EXIT_TRAINER_LOST)
        os._exit(EXIT_TRAINER_LOST)

    def _serve(self, store: dist.Store, hb: Heartbeat, pool: ThreadPoolExecutor) -> int:
        sender = SampleSender(store, self.transport.control, self.transport.channel, self.cfg.worker_id)
        gate = StalenessGate(store, self.transport.channel, worker_id=self.cfg.worker_id)
        engine_device = getattr(self.engine, "device", None)  # a worker on its leader's GPU gets CUDA IPC
        receiver = WeightReceiver(store, self.transport.control, self.transport.weight_sync, self.cfg.worker_id,
                                  self.engine.load_weights, initial_version=self.cfg.initial_version,
                                  gpu=device_uuid(engine_device) if isinstance(engine_device, torch.device) else None)
        pending: list[_Pending] = []

        def safe_point() -> None:
            hb.step = receiver.maybe_sync() or hb.step
            self.weights_version = receiver.version

        while not stop_requested(store):
            pending = self._flush(sender, gate, pending, safe_point, lambda: stop_requested(store),
                                  wait=False)
            safe_point()
            if not receiver.can_generate():
                time.sleep(self.cfg.idle_sleep_s)
                continue
            tickets = self._reserve(gate)
            if not tickets:
                time.sleep(self.cfg.idle_sleep_s)
                continue
            pending += self._generate(store, tickets, receiver.version, pool)
        # Drain what was generated, but only while the hub still takes groups: a trainer that
        # stopped receiving would leave us waiting on back-pressure until the store closes, so
        # give up after half the heartbeat timeout (the trainer waits a full one for our exit).
        # Unsent groups are not lost: a resumed run restarts this worker's prompts after the
        # groups the trainer checkpointed as received (loop/resume.py).
        deadline = time.monotonic() + self.transport.heartbeat.timeout_s / 2
        before = self.groups_sent
        left = self._flush(sender, gate, pending, safe_point, lambda: time.monotonic() > deadline, wait=True)
        log.info("%s: stop flag seen; drained %d groups (%d sent in all), %d left unsent",
                 self.me.describe(), self.groups_sent - before, self.groups_sent, len(left))
        return EXIT_OK

    def _reserve(self, gate: StalenessGate) -> list[StartTicket]:
        tickets = []
        while len(tickets) < self.cfg.groups_per_batch:
            ticket = gate.try_start()
            if ticket is None:
                break
            tickets.append(ticket)
        return tickets

    def _generate(self, store: dist.Store, tickets: list[StartTicket], version: int,
                  pool: ThreadPoolExecutor) -> list[_Pending]:
        records = [self.prompts.next() for _ in tickets]
        start = time.monotonic()
        outputs = self.engine.generate([list(r.token_ids) for r in records], self.sampling)
        self.engine_seconds += time.monotonic() - start
        store.set(Keys.engine_seconds(self.cfg.worker_id), repr(self.engine_seconds))
        out = []
        for ticket, record, gens in zip(tickets, records, outputs):
            group = self._group(record, gens, version)
            texts = [self.decode(g.token_ids.tolist()) for g in gens]
            out.append(_Pending(group, ticket, pool.submit(self._rewards, record.record, texts)))
        return out

    def _rewards(self, record: Any, texts: list[str]) -> list[float]:
        return [float(self.reward_fn(record, text)) for text in texts]

    def _group(self, record: PromptRecord, gens: list[Generation], version: int) -> SampleGroup:
        num = self.transport.control.num_workers
        group_id = self.groups_made * num + self.cfg.worker_id
        self.groups_made += 1
        prompt = torch.tensor(record.token_ids, dtype=torch.int64)
        samples = [
            Sample(sample_id=group_id * len(gens) + i, prompt_ids=prompt, response_ids=g.token_ids.to(torch.int64),
                   behavior_logprobs=g.logprobs.to(torch.float32),
                   token_versions=torch.full_like(g.token_ids, version, dtype=torch.int64),
                   truncated=g.finish_reason == "length")
            for i, g in enumerate(gens)
        ]
        return SampleGroup(group_id=group_id, prompt_id=record.prompt_id, samples=samples, worker_id=self.cfg.worker_id)

    def _flush(self, sender: SampleSender, gate: StalenessGate, pending: list[_Pending],
               safe_point: Callable[[], None], stopped: Callable[[], bool], wait: bool) -> list[_Pending]:
        left = []
        for i, p in enumerate(pending):
            if not wait and not p.rewards.done():
                left.append(p)
                continue
            for sample, reward in zip(p.group.samples, p.rewards.result()):
                sample.reward = reward
            if sender.send(p.group, p.ticket, while_waiting=safe_point, stopped=stopped) is None:
                return left + pending[i:]  # stop flag raised while blocked: leave unsent
            gate.posted(p.ticket)
            self.groups_sent += 1
        return left
