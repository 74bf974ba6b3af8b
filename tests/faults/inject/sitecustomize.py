"""Fault injection into a real rollout worker or trainer rank started by ``python -m launch.train``.

Loaded by every Python process whose PYTHONPATH lists this folder (a test sets it for the
launcher, whose children inherit it); it acts only in rollout workers (``--worker-id`` on the
command line) or trainer ranks (``--config`` and ``RANK``), and only when ``DARL_FAULT`` asks:

- ``stall_after:N``: the engine's ``generate`` hangs forever from its (N+1)-th call on, while the
  worker's heartbeat thread keeps beating (a worker alive but producing nothing).
- ``nan_weight_at:N``: before the trainer's N-th train step (1-based) one value of the final
  norm's weight becomes NaN on every rank (memory corrupted, or a step that overflowed): every
  logit, the loss and the gradients go NaN from there on.

Nothing of the product reads ``DARL_FAULT``; the code under test is unchanged.
"""

import os
import sys

_FAULT = os.environ.get("DARL_FAULT", "")

if _FAULT.startswith("stall_after:") and "--worker-id" in sys.argv:
    import threading

    from megatron_darl.rollout.engines import hf

    _calls = {"n": 0}
    _limit = int(_FAULT.split(":", 1)[1])
    _generate = hf.HFEngine.generate

    def _stalling_generate(self, *args, **kwargs):
        _calls["n"] += 1
        if _calls["n"] > _limit:
            threading.Event().wait()  # forever: only a kill ends this worker
        return _generate(self, *args, **kwargs)

    hf.HFEngine.generate = _stalling_generate


if _FAULT.startswith("nan_weight_at:") and "--config" in sys.argv and "--worker-id" not in sys.argv \
        and os.environ.get("RANK") is not None:
    import torch

    from megatron_darl.trainer import policy_trainer

    _steps = {"n": 0}
    _at = int(_FAULT.split(":", 1)[1])
    _train_steps = policy_trainer.PolicyTrainer.train_steps

    def _poisoned_train_steps(self, minibatches, loss_fn):
        _steps["n"] += 1
        if _steps["n"] == _at:
            with torch.no_grad():
                for name, p in self.model_chunks[0].named_parameters():
                    if "final_layernorm" in name:
                        p.view(-1)[0] = float("nan")
        return _train_steps(self, minibatches, loss_fn)

    policy_trainer.PolicyTrainer.train_steps = _poisoned_train_steps
