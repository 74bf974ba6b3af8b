"""The train step's phase clock (trainer/phases.py): sums by phase between marks, and idle outside
``start()`` .. ``seconds()`` (the trainer's warm-up runs the same finalize hook)."""

from __future__ import annotations

import pytest
import torch

from megatron_darl.trainer.phases import PhaseClock


def test_marks_sum_by_phase_and_are_ignored_outside_a_step(monkeypatch):
    now = iter([0.0, 0.02, 0.021, 0.031, 0.051, 0.052, 0.062])  # the clock's reads, scripted
    clock = PhaseClock(torch.device("cpu"))
    monkeypatch.setattr(clock, "_now", lambda: next(now))
    clock.mark("forward_backward")  # before start: a warm-up's finalize, not timed (no read)
    assert clock.seconds() == {}
    clock.start()
    for _ in range(2):
        clock.mark("forward_backward")
        clock.mark("grad_reduce")
        clock.mark("optimizer")
    got = clock.seconds()
    assert got == pytest.approx({"forward_backward": 0.04, "grad_reduce": 0.002, "optimizer": 0.02})
    clock.mark("optimizer")  # after seconds(): idle again
    assert clock.seconds() == {}
