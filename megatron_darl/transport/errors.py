"""The transport's own exceptions, in a module of their own so that the store client and the
ledger (``control_store.py``, ``ledger.py``) can both raise them without importing each other, and
the one rule for making a request again after its deadline."""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class TransportTimeout(TimeoutError):
    """A store wait, a collective or a handshake ran past its timeout."""


class ForeignValueError(ValueError):
    """A store value without a valid tag of this run's secret: written by a foreign process."""


def again_on_timeout(request: Callable[[], T], tries: int, who: str, stop: Callable[[], bool] = lambda: False) -> T:
    """``request()``, made again when it raises ``TransportTimeout``, up to ``tries`` times (not
    once ``stop()``), each retry logged as ``who``'s. Only for a request that may run twice, or
    that the other end recognizes as the same one (``ledger.call_once``): a call past its
    deadline may have been applied with only its answer lost."""
    attempt = 1
    while True:
        try:
            return request()
        except TransportTimeout as exc:
            if attempt >= tries or stop():
                raise
            attempt += 1
            log.warning("%s: %s; trying again (%d of %d)", who, exc, attempt, tries)
