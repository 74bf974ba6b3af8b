"""A user's own reward function, named on the command line: ``reward.fn=package.module:function``.

Why: a reward that is not built in needs no edit of the enum and table in
``rewards/registry.py``. verl and OpenRLHF users bring a function, so ``reward.fn`` names one,
as a module on the Python path (``my_rewards.gsm8k:compute_score``) or a file
(``path/to/reward.py:compute_score``, relative to where the run is launched). It replaces the verifier of ``data.task`` in the rollout
workers (and wherever ``get_reward_fn`` is asked with the run's ``RewardConfig``).

The function is called with verl's ``compute_score`` keywords, so a verl reward file works as it
is::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float

- ``data_source``: the record's ``metadata["data_source"]`` when its dataset copies that column
  (``data.fields.metadata``), else the record's task (``math``, ``gsm8k``, ...);
- ``solution_str``: the decoded response (special tokens skipped);
- ``ground_truth``: the record's reference as stored (``data.fields.reference``);
- ``extra_info``: a fresh dict: the record's metadata, plus ``index`` (prompt id), ``prompt``,
  ``messages``, ``task``, ``tests`` (stdio cases) and ``source`` ("file:line");
- ``reward.fn_kwargs``: further keywords of every call (verl's ``reward_kwargs``).

It returns a number (bool, int, float, a numpy or 0-d torch scalar) or verl's dict with a
``"score"`` entry. An ``async def`` function is awaited in an event loop of its own. An
OpenRLHF ``reward_func(queries, prompts, labels)`` is one line away::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(reward_func([extra_info["prompt"] + solution_str], [extra_info["prompt"]],
                                 [ground_truth])["rewards"][0])

The name is resolved and its signature checked before launch (``check_reward``, exit 2 with
one line naming ``reward.fn``). At run time a call that raises, returns something that is not
a finite number, or takes longer than ``reward.fn_timeout_s`` is handled as the built-in
verifiers' failures are: it scores 0.0, is counted (``reward_errors``, or ``reward_timeouts``
past the deadline, in the trainer's metrics) and logged with the record's id (the first with
its traceback, then one line at the 2nd, 4th, 8th, ... failure), never a crash of the worker.
Calls run in daemon threads, at most ``reward.fn_max_inflight`` at once: a call that never
returns keeps one slot and is left behind, never waited for past its deadline.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from megatron_darl import counters
from megatron_darl.data.records import PromptRecord
from megatron_darl.rewards.config import RewardConfig

logger = logging.getLogger(__name__)

_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")


def _import_file(spec: str, path_text: str) -> Any:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward.fn={spec}: no such file {path}")
    name = f"darl_reward_{path.stem}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"reward.fn={spec}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    return module


def _import_module(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"reward.fn={spec}: no module named {exc.name!r} on the Python path (the launch "
                             "directory and PYTHONPATH); add the directory that holds it to PYTHONPATH, or "
                             "give a file: reward.fn=path/to/file.py:function") from None
        raise ValueError(f"reward.fn={spec}: importing {module_name} failed: {exc}") from None
    except Exception as exc:
        raise ValueError(f"reward.fn={spec}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names (``module:attr`` or ``file.py:attr``; ``attr`` may be dotted).

    Raises:
        ValueError: one line naming ``reward.fn``: a bad form, a missing module or file, an import
            that fails, a missing attribute, or a value that is not callable.
    """
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"reward.fn={spec!r}: use package.module:function or path/to/file.py:function")
    is_file = where.endswith(".py") or "/" in where
    module = _import_file(spec, where) if is_file else _import_module(spec, where)
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            origin = getattr(module, "__file__", where)
            raise ValueError(f"reward.fn={spec}: {origin} has no attribute {attr!r}")
        value = getattr(value, part)
    if not callable(value):
        raise ValueError(f"reward.fn={spec}: {attr} is a {type(value).__name__}, not a function")
    return value


def check_signature(fn: Callable[..., Any], spec: str, kwargs: dict[str, Any]) -> None:
    """``fn`` accepts verl's four keywords and ``reward.fn_kwargs`` (else one-line ``ValueError``)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its first call will tell
    try:
        signature.bind(**{k: None for k in _KEYWORDS}, **kwargs)
    except TypeError as exc:
        raise ValueError(f"reward.fn={spec}: {getattr(fn, '__name__', spec)}{signature} cannot be called as "
                         f"fn(data_source=, solution_str=, ground_truth=, extra_info=" +
                         "".join(f", {k}=" for k in kwargs) + f"): {exc}") from None


def check_reward(cfg: Any) -> None:
    """Pre-launch check of a run config's ``reward.fn`` (nothing to do when it is empty)."""
    if cfg.reward.fn:
        check_signature(load_reward_fn(cfg.reward.fn), cfg.reward.fn, dict(cfg.reward.fn_kwargs))


def as_reward(value: Any) -> float:
    """The float of a reward function's return value; ``TypeError``/``ValueError`` say why not."""
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"returned a dict without 'score' (keys: {sorted(map(str, value))[:8]})")
        value = value["score"]
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # numpy and 0-d torch scalars
        except (TypeError, ValueError, RuntimeError):
            pass
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {repr(value)[:80]}, not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"returned {reward}, not a finite number")
    return reward


def _record_name(record: PromptRecord) -> str:
    name = f"prompt {record.prompt_id}"
    source_id = record.metadata.get("source_id")
    if source_id not in (None, "", record.prompt_id):
        name += f" (id {source_id})"
    return name + (f" at {record.source}" if record.source else "")


def call_arguments(record: PromptRecord, response: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords of one call: verl's four and ``reward.fn_kwargs`` (see the module docstring)."""
    extra = {**record.metadata, "index": record.prompt_id, "prompt": record.prompt,
             "messages": record.messages, "task": record.task, "tests": record.tests, "source": record.source}
    return {"data_source": record.metadata.get("data_source") or record.task, "solution_str": response,
            "ground_truth": record.reference, "extra_info": extra, **kwargs}


async def _bounded(awaitable: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(awaitable, timeout_s)


class _Timeout(Exception):
    """The call did not return within its deadline (or found no free slot in time)."""


class CustomReward:
    """``reward_fn(record, response) -> float`` around a user's function (module docstring)."""

    def __init__(self, fn: Callable[..., Any], spec: str, timeout_s: float, max_inflight: int,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.fn, self.spec, self.timeout_s = fn, spec, timeout_s
        self.kwargs = dict(kwargs or {})
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._lock = threading.Lock()
        self._failures = 0  # this instance's, for the log's pacing (the metrics count every one)

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> "CustomReward":
        fn = load_reward_fn(cfg.fn)
        check_signature(fn, cfg.fn, dict(cfg.fn_kwargs))
        return cls(fn, cfg.fn, cfg.fn_timeout_s, cfg.fn_max_inflight, dict(cfg.fn_kwargs))

    def __call__(self, record: PromptRecord, response: str) -> float:
        try:
            return as_reward(self._call(call_arguments(record, response, self.kwargs)))
        except _Timeout as exc:
            total = counters.count(counters.REWARD_TIMEOUTS)
            self._log(record, f"gave no reward within reward.fn_timeout_s={self.timeout_s:g}s{exc}",
                      f"{counters.REWARD_TIMEOUTS}={total}", None)
        except Exception as exc:  # the user's code or value: scored 0.0, never the worker's end
            total = counters.count(counters.REWARD_ERRORS)
            self._log(record, f"{type(exc).__name__}: {exc}", f"{counters.REWARD_ERRORS}={total}", exc)
        return 0.0

    def _call(self, kwargs: dict[str, Any]) -> Any:
        """The function's value, awaited when it is a coroutine; ``_Timeout`` past the deadline."""
        deadline = time.monotonic() + self.timeout_s
        if not self._slots.acquire(timeout=self.timeout_s):
            raise _Timeout(" (every slot of reward.fn_max_inflight taken by calls still running)")
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                value = self.fn(**kwargs)
                if inspect.isawaitable(value):
                    value = asyncio.run(_bounded(value, max(deadline - time.monotonic(), 1e-3)))
                box["value"] = value
            except (asyncio.TimeoutError, TimeoutError):
                box["timeout"] = True
            except BaseException as exc:  # handed to the caller's thread; a sys.exit() in it ends no worker
                box["error"] = exc if isinstance(exc, Exception) else RuntimeError(f"raised {exc!r}")
            finally:
                self._slots.release()
                done.set()

        threading.Thread(target=run, name="custom-reward", daemon=True).start()
        if not done.wait(max(deadline - time.monotonic(), 0.0)) or box.get("timeout"):
            raise _Timeout("")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _log(self, record: PromptRecord, why: str, counted: str, exc: BaseException | None) -> None:
        with self._lock:
            self._failures += 1
            n = self._failures
        if n & (n - 1):
            return  # only the 1st, 2nd, 4th, 8th, ... failure is logged
        message = "reward.fn=%s on %s scored 0.0 (failure %d of reward.fn in this process; %s): %s"
        args = (self.spec, _record_name(record), n, counted, why)
        if n == 1 and exc is not None:
            logger.error(message, *args, exc_info=(type(exc), exc, exc.__traceback__))
        else:
            logger.error(message, *args)
