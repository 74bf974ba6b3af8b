"""Fault injection into a real rollout worker started by ``python -m launch.train``.

Loaded by every Python process whose PYTHONPATH lists this folder (a test sets it for the
launcher, whose children inherit it); it acts only in rollout workers (``--worker-id`` on the
command line) and only when ``DARL_FAULT`` asks for it:

- ``stall_after:N``: the engine's ``generate`` hangs forever from its (N+1)-th call on, while the
  worker's heartbeat thread keeps beating (a worker alive but producing nothing).

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
