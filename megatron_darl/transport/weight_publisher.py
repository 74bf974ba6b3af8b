"""Weight sync off the trainer's critical path: stage the weights now, publish them from a thread.

Why: a publish waits for every rollout worker's safe point, and a worker reaches one only between
generation steps (a batch engine: after its whole batch; ``finish`` mode: once its groups in
flight are done). A trainer that publishes inline idles that long at every step: measured on 4
H200s at Qwen3-1.7B with two ``hf`` workers, 6.7 s of a 10.6 s step.

So the trainer only stages a version (``WeightSender.stage_weights``: every bucket packed into buffers on
its device, one copy of the stage's HF tensors, in its stream order, so the next optimizer step
cannot change what is sent) and goes on. A thread runs the whole ``WeightSender.publish`` (offer,
wait for the workers, broadcast on a stream of its own, acks, published version). The workers get
the newest version staged when they reach their safe point (``upgrade``, per round of the
publish), and a publish that served someone ends once a newer version is staged, so the workers
still to come take that one from the next publish: no worker waits for another, none gets older
weights than the trainer has staged, and versions nobody took are skipped. At most two copies
are staged (the one in flight and the newest). Only for one PP stage: with several, each stage leader
would pick its newest on its own and a worker could load stages of different versions.

A failed sync is raised by the next ``submit`` (or ``wait``), which the loop treats as it treats a
blocking publish that failed; ``wait`` bounds its wait by the sync's own timeouts.

Between publishes the thread keeps the last version it sent and offers it again to a worker
that reached its safe point after the rounds ended and holds older weights
(``WeightSender.waiting_for``): a restarted worker, or one too late for its rounds. Without
that, a worker that is the only one left could wait for weights that only the next trainer step
would bring, while that step waits for its groups. The kept copy is one of the two staged at
most. (A blocking publish has no copy to offer again: such a worker waits for the next step's.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterable

import torch

from megatron_darl.transport.store import TransportTimeout
from megatron_darl.transport.weight_sync import StagedWeights, SyncReport, WeightSender

log = logging.getLogger(__name__)


class BackgroundPublisher:
    """Publishes a ``WeightSender``'s staged versions from a thread; see the module docstring."""

    def __init__(self, sender: WeightSender, device: torch.device | None = None, linger_s: float = 0.5) -> None:
        self._sender, self.linger_s = sender, linger_s  # how often an idle thread looks for late workers
        self.timeout_s = sender.cfg.publish_bound_s  # the longest one publish may take
        self._stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self._cv = threading.Condition()
        self._newest: StagedWeights | None = None  # staged, not yet taken by a publish
        self._current: StagedWeights | None = None  # taken by the publish in flight
        self._last: StagedWeights | None = None  # the last version sent, offered again to late workers
        self._draining = False  # ``wait`` was called: no more offers of the last version
        self._report: SyncReport | None = None  # the last finished publish, not yet handed out
        self._error: BaseException | None = None  # why the last publish failed (the thread stops)
        self._closed = False
        self._gave_up = False  # ``wait`` timed out on the publish in flight
        self._thread = threading.Thread(target=self._run, name=f"weight-sync-{sender.stage}", daemon=True)
        self._thread.start()

    def submit(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport | None:
        """Stage ``version`` and return: the last sync that finished since the previous call, or
        None. Raises the failure of a sync that failed (``WeightSyncFailed``, ``TransportTimeout``)."""
        with self._cv:
            self._newest = None  # superseded: free it before staging the next (two copies at most)
        staged = self._sender.stage_weights(version, named)
        with self._cv:
            self._raise_failure()
            self._newest = staged
            self._cv.notify_all()
            return self._take_report()

    def wait(self) -> SyncReport | None:
        """Until every staged version is published; the last report. Raises as ``submit`` does,
        and ``TransportTimeout`` past the longest a publish may take."""
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            self._draining = True
            while (self._newest is not None or self._current is not None) and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._gave_up = True  # ``close`` does not wait for that publish a second time
                    raise TransportTimeout(f"weight sync stage {self._sender.stage}: still publishing "
                                           f"after {self.timeout_s:.0f} s")
                self._cv.wait(left)
            self._raise_failure()
            return self._take_report()

    def failure(self, wait_s: float = 0.0) -> BaseException | None:
        """Why a publish failed, or None; waits up to ``wait_s`` for the one in flight to end (a
        run that is failing anyway names the precise cause: a worker that could not load)."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while self._error is None and self._current is not None and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))
            return self._error

    def close(self) -> None:
        """Stop the thread once the publish in flight (if any) is over, at most ``timeout_s`` (a
        few seconds once ``wait`` gave up on it: the thread is a daemon); staged versions are dropped."""
        with self._cv:
            self._closed = True
            self._newest = self._last = None
            self._cv.notify_all()
        self._thread.join(timeout=5.0 if self._gave_up else self.timeout_s)

    # ---- the thread ---------------------------------------------------------------------------
    def _latest(self) -> StagedWeights:
        """The newest staged version (the publish's ``upgrade``, once every worker is ready)."""
        with self._cv:
            if self._newest is not None:
                self._current, self._newest = self._newest, None
            return self._current

    def _has_newer(self) -> bool:
        """A version staged since the publish in flight took its newest."""
        with self._cv:
            return self._newest is not None

    def _run(self) -> None:
        """Publish until closed. Whatever ends the thread early, a publish that failed or a look
        for late workers (``_next``: store reads) that raised, is handed to the trainer's thread:
        a thread that died unseen would leave ``submit`` staging versions nobody sends."""
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        try:
            with stream:
                while (staged := self._next()) is not None:
                    report = self._sender.publish(staged.version, staged, upgrade=self._latest,
                                                  newer=self._has_newer)
                    if self._stream is not None:
                        self._stream.synchronize()  # the buffers are free only once the sends are done
                    with self._cv:
                        self._report, self._last, self._current = report, self._current, None
                        self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread
            with self._cv:
                self._error, self._current, self._last = exc, None, None
                self._cv.notify_all()

    def _next(self) -> StagedWeights | None:
        """What to publish next: the newest staged version, else (once some worker waits for it)
        the last one sent again; None once closed."""
        while True:
            with self._cv:
                if self._closed:
                    return None
                if self._newest is not None:
                    self._current, self._newest, self._last = self._newest, None, None
                    return self._current
                last = None if self._draining else self._last
                if last is None:
                    self._cv.wait()
                    continue
            if self._sender.waiting_for(last.version):  # store reads: not under the lock
                with self._cv:
                    if self._newest is None and not self._closed and self._last is last and not self._draining:
                        log.info("weight sync: offering v%d again to a worker that came after its rounds",
                                 last.version)
                        self._current = last
                        return last
                continue
            with self._cv:
                if self._newest is None and not self._closed:
                    self._cv.wait(self.linger_s)

    def _take_report(self) -> SyncReport | None:
        report, self._report = self._report, None
        return report

    def _raise_failure(self) -> None:
        if self._error is not None:  # sticky: nothing is published after a failure
            raise self._error
