"""Held-out evaluation while training, carried between the trainer and one rollout worker.

Why on a rollout worker: it already holds each version the trainer publishes, in an engine made
for generation, so a point costs only the held-out generations (no checkpoint, no second model).
Why the trainer decides: it alone knows the run's last version, and which versions a resumed run
already logged. The protocol, over the control store:

- trainer rank 0 (``HeldoutRequests``): before it publishes a version that is due
  (``eval.periodic.is_due``) and not logged yet, it sets ``darl/eval/request/<v>``; after each
  step it reads the results that came in (never waits), and at the end it waits for the ones
  still out, each at most ``eval.timeout_s`` from its request: a result that does not come (the
  worker missed that version, or died) is named in one warning line and skipped.
- the worker ``eval.worker`` (``HeldoutServer``, the worker's ``on_version`` hook): whenever its
  engine has loaded a version (the initial one included), if that version is requested it scores
  the held-out sets with its engine and posts ``darl/eval/result/<v>`` (JSON; an evaluation that
  failed posts its error, and the worker goes on generating). A worker may go past a version
  without loading it (it came to a sync late and the next offer brought a newer one): it then
  posts each requested version it went past as missed, so the trainer names it at once instead
  of waiting ``eval.timeout_s`` at the end for a point that cannot come.

An evaluation is not training: its generations go through ``engine.generate`` directly, never
through the staleness gate or the sample channel, so they are neither counted nor trained, and
the staleness bound is untouched (the worker only generates nothing meanwhile). The points are
logged by ``MetricsLogger.log_heldout`` under the version they score (``step`` = version).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterable

from megatron_darl.eval.config import PeriodicEvalConfig
from megatron_darl.eval.periodic import is_due, score_version

log = logging.getLogger(__name__)
POLL_S = 0.2  # between reads of the results still out, at the end of the run


def request_key(version: int) -> str:
    return f"darl/eval/request/{version}"


def result_key(version: int) -> str:
    return f"darl/eval/result/{version}"


class HeldoutRequests:
    """Trainer rank 0: ask for the due versions, collect their points (see the module docstring)."""

    def __init__(self, cfg: PeriodicEvalConfig, steps: int, store, logged: Iterable[int] = ()) -> None:
        self.cfg, self.steps, self.store = cfg, steps, store
        self.logged = set(logged)  # versions with a point in metrics.jsonl (a resumed run's)
        self.pending: dict[int, float] = {}  # version -> deadline (monotonic)

    def request(self, version: int) -> bool:
        """Ask for ``version`` when it is due and not logged yet; True when asked."""
        final = version == self.steps
        if version in self.logged or version in self.pending or not is_due(self.cfg, version, final):
            return False
        self.store.set(request_key(version), json.dumps({"version": version}))
        self.pending[version] = time.monotonic() + self.cfg.timeout_s
        return True

    def poll(self) -> list[dict[str, Any]]:
        """The points that came in since the last call (one store read per version still out)."""
        points = []
        for version, deadline in sorted(self.pending.items()):
            raw = self.store.read(result_key(version))
            if raw is not None:
                del self.pending[version]
                point = json.loads(raw)
                if point.get("error"):
                    log.warning("eval: version %d not scored: %s", version, point["error"])
                    continue
                self.logged.add(version)
                points.append(point)
            elif time.monotonic() > deadline:
                del self.pending[version]
                log.warning("eval: no result for version %d from rollout worker %d within eval.timeout_s=%.0f s "
                            "(the worker missed that version or is gone); skipped", version, self.cfg.worker,
                            self.cfg.timeout_s)
        return points

    def drain(self, wait: bool, alive: Callable[[], bool] = lambda: True) -> list[dict[str, Any]]:
        """Every point still out: with ``wait``, waiting at most until each one's deadline or until
        the evaluating worker is gone (``alive``); else only those already in."""
        points = self.poll()
        while wait and self.pending and alive():
            time.sleep(POLL_S)
            points += self.poll()
        if self.pending:
            why = f"rollout worker {self.cfg.worker} is gone" if wait else "the run stopped before its last step"
            log.warning("eval: no result for version(s) %s: %s", sorted(self.pending), why)
            self.pending.clear()
        return points


class HeldoutServer:
    """The evaluating worker's hook: score each requested version its engine loads."""

    def __init__(self, cfg: PeriodicEvalConfig, sets: dict[str, list], engine, tokenizer, ecfg,
                 connect: Callable[[], Any]) -> None:
        self.cfg, self.sets, self.engine, self.tokenizer, self.ecfg = cfg, sets, engine, tokenizer, ecfg
        self._connect, self._store = connect, None
        self.seconds = 0.0  # wall seconds spent evaluating
        self.scored: list[int] = []  # versions this process scored
        self.missed: list[int] = []  # requested versions the engine went past without loading
        self._last: int | None = None  # the version of the last call (None: none yet)

    def __call__(self, version: int) -> None:
        """At a safe point with ``version`` loaded: score it when the trainer asked for it."""
        if not self.sets or version < 0:
            return
        if self._store is None:
            self._store = self._connect()
        last, self._last = self._last, version
        if last is not None:  # a resumed worker's first version leaves nothing behind it
            for skipped in range(last + 1, version):
                self._post_missed(skipped, last, version)
        if not self._unanswered(version):
            return
        start = time.monotonic()
        try:
            point = score_version(version, self.sets, self.engine, self.tokenizer, self.ecfg)
        except Exception as exc:  # noqa: BLE001 (an evaluation never stops generation: it is reported)
            log.exception("eval: scoring version %d failed", version)
            point = {"version": version, "error": f"{type(exc).__name__}: {exc}"}
        self.seconds += time.monotonic() - start
        self._store.set(result_key(version), json.dumps(point))
        if not point.get("error"):
            self.scored.append(version)
            log.info("eval: version %d scored in %.1f s: %s", version, point["seconds"],
                     ", ".join(f"{n} avg@{r['n']} {r['avg_at_n']:.3f}" for n, r in point["results"].items()))

    def _unanswered(self, version: int) -> bool:
        """The trainer asked for ``version`` and no result is posted yet."""
        return self._store.read(request_key(version)) is not None and not self._store.check([result_key(version)])

    def _post_missed(self, version: int, before: int, after: int) -> None:
        """Post ``version`` as not scored when it was requested and has no result yet."""
        if not self._unanswered(version):
            return
        why = (f"rollout worker {self.cfg.worker} went from version {before} to {after} without loading it "
               "(it joined that weight sync late)")
        self._store.set(result_key(version), json.dumps({"version": version, "error": why}))
        self.missed.append(version)
        log.warning("eval: version %d not scored: %s", version, why)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
