"""The transport's own exceptions, in a module of their own so that the store client and the
ledger (``control_store.py``, ``ledger.py``) can both raise them without importing each other."""


class TransportTimeout(TimeoutError):
    """A store wait, a collective or a handshake ran past its timeout."""


class ForeignValueError(ValueError):
    """A store value without a valid tag of this run's secret: written by a foreign process."""
