"""Where a train step's device time goes: forward/backward, the gradient reduce over DP and the
optimizer update.

A train step of M mini-batches runs, per mini-batch, the forward/backward passes, Megatron's
``finalize_model_grads`` (the gradients' reduce-scatter over DP with the distributed optimizer,
all-reduce without) and ``optimizer.step()`` (gradient norm, Adam on this rank's shard, the
parameters' all-gather). The first and last scale down with DP; the collectives do not. Which
part keeps a DP2 step from halving is what the loop's scaling asks, and host clocks cannot say:
on a GPU the kernels run behind the host and the step's one host sync comes at its end.

So the clock records CUDA events on the current stream between the phases (the collectives run
on it: ``overlap_grad_reduce=False``) and reads them after the step's own sync: no sync is added.
On CPU every op is synchronous and ``time.perf_counter`` does the same.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseClock:
    """Sums of the time between marks, by the name of the phase each mark ends; idle (marks are
    ignored) outside ``start()`` .. ``seconds()``, e.g. in the trainer's warm-up."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []
        self._active = False

    def _now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._marks = [("", self._now())]
        self._active = True

    def mark(self, phase: str) -> None:
        """The phase that ends here: it ran since the previous mark (or ``start``)."""
        if self._active:
            self._marks.append((phase, self._now()))

    def seconds(self) -> dict[str, float]:
        """Seconds by phase since ``start``; ends the clock. Call after the step's host sync (the
        last event is waited for, which then costs nothing)."""
        marks, self._marks, self._active = self._marks, [], False
        if len(marks) < 2:
            return {}
        if self.cuda:
            marks[-1][1].synchronize()
        out: dict[str, float] = defaultdict(float)
        for (_, before), (phase, after) in zip(marks, marks[1:]):
            out[phase] += (before.elapsed_time(after) / 1e3 if self.cuda else after - before)
        return dict(out)
