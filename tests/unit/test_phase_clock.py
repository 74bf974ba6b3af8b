"""The train step's phase clock (trainer/phases.py): sums by phase between marks, and idle outside
``start()`` .. ``seconds()`` (the trainer's warm-up runs the same finalize hook)."""

from __future__ import annotations

import time

import torch

from megatron_darl.trainer.phases import PhaseClock


def test_marks_sum_by_phase_and_are_ignored_outside_a_step():
    clock = PhaseClock(torch.device("cpu"))
    clock.mark("forward_backward")  # before start: a warm-up's finalize, not timed
    assert clock.seconds() == {}
    clock.start()
    for _ in range(2):
        time.sleep(0.02)
        clock.mark("forward_backward")
        clock.mark("grad_reduce")
        time.sleep(0.01)
        clock.mark("optimizer")
    got = clock.seconds()
    assert set(got) == {"forward_backward", "grad_reduce", "optimizer"}
    assert got["forward_backward"] >= 0.04 and 0.02 <= got["optimizer"] < got["forward_backward"]
    assert got["grad_reduce"] < 0.005
    clock.mark("optimizer")  # after seconds(): idle again
    assert clock.seconds() == {}
