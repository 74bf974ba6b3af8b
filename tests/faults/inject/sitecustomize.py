"""Fault injection into a real rollout worker or trainer rank started by ``python -m launch.train``.

Loaded by every Python process whose PYTHONPATH lists this folder (a test sets it for the
launcher, whose children inherit it); it acts only in rollout workers (``--worker-id`` on the
command line) or trainer ranks (``--config`` and ``RANK``), and only when ``DARL_FAULT`` asks:

- ``stall_after:N``: the engine's ``generate`` hangs forever from its (N+1)-th call on, while the
  worker's heartbeat thread keeps beating (a worker alive but producing nothing); it leaves
  ``stalled_rolloutW`` next to the run config (``--config``) as it starts to hang.
- ``kill:W:sync:N``: rollout worker W SIGKILLs itself in its N-th weight sync, once it is a
  member of the round and the leader is about to send (its data-plane group is built).
- ``kill:W:generate:N``: rollout worker W SIGKILLs itself in the N-th call of the engine's
  ``generate`` (its batch reserved against the staleness bound, generating).
  W may list several workers (``kill:0,1:generate:2``): each kills itself at its own N-th call.
- ``nan_weight_at:N``: before the trainer's N-th train step (1-based) one value of the final
  norm's weight becomes NaN on every rank (memory corrupted, or a step that overflowed): every
  logit, the loss and the gradients go NaN from there on.

A kill fires in the first process of worker W only: it leaves ``fault_fired_rolloutW`` next to
the run config (``--config``), so a worker restarted with the same id runs clean.

Nothing of the product reads ``DARL_FAULT``; the code under test is unchanged.
"""

import os
import sys
from pathlib import Path

_FAULT = os.environ.get("DARL_FAULT", "")


def _arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv[:-1] else ""


if _FAULT.startswith("stall_after:") and "--worker-id" in sys.argv:
    import threading

    from megatron_darl.rollout.engines import hf

    _calls = {"n": 0}
    _limit = int(_FAULT.split(":", 1)[1])
    _generate = hf.HFEngine.generate

    def _stalling_generate(self, *args, **kwargs):
        _calls["n"] += 1
        if _calls["n"] > _limit:
            if _arg("--config"):
                (Path(_arg("--config")).parent / f"stalled_rollout{_arg('--worker-id')}").touch()
            threading.Event().wait()  # forever: only a kill ends this worker
        return _generate(self, *args, **kwargs)

    hf.HFEngine.generate = _stalling_generate

if _FAULT.startswith("kill:") and _arg("--worker-id") in _FAULT.split(":")[1].split(","):
    import signal

    _, _, _where, _nth = _FAULT.split(":")
    _mark = Path(_arg("--config")).parent / f"fault_fired_rollout{_arg('--worker-id')}"
    _count = {"n": 0}

    def _kill_on_nth(fn):
        def wrapped(*args, **kwargs):
            _count["n"] += 1
            if _count["n"] == int(_nth) and not _mark.exists():
                _mark.write_text(f"{os.getpid()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return wrapped

    if _where == "sync":
        from megatron_darl.transport import weight_receiver

        weight_receiver.WeightReceiver._receive_buckets = _kill_on_nth(
            weight_receiver.WeightReceiver._receive_buckets)
    elif _where == "generate":
        from megatron_darl.rollout.engines import hf

        hf.HFEngine.generate = _kill_on_nth(hf.HFEngine.generate)
    else:
        raise ValueError(f"DARL_FAULT={_FAULT!r}: where must be sync or generate")

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
