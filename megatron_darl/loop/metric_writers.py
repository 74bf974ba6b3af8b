"""The metrics' file writers, made to outlive a full disk: they log once and retry later.

Why: a few seconds of full disk mid-run must not kill the trainer. Through TensorBoard's own
writer it does (the ``No space left on device`` of ``SummaryWriter``'s background thread,
re-raised at the next ``add_scalar``): 4 of 7 trials on a 44 MiB tmpfs measured exit 1 or 134,
no checkpoint and no line saying why, while the run's state in memory was fine and the disk was
free again seconds later. Metrics are worth no run. So both files here are written the same way:

* ``RecordAppender`` appends whole records or nothing: each record is one ``os.write`` on an
  ``O_APPEND`` descriptor, and a failed or short write is cut back to where it began
  (``ftruncate`` needs no space), so a reader (a resumed run, TensorBoard) never meets half a
  record. Records that could not be written wait in memory, in order, and go first at the next
  write. ``Outage`` is the log-once rule: the first failure of an outage is one warning naming
  the file and the error, then nothing until the writer has caught up (one info line).
* ``metrics.jsonl``: one record per line (``LineAppender``).
* TensorBoard: ``TensorBoardEvents`` writes the event file itself (TensorBoard's record framing
  and protobufs, the scalars ``SummaryWriter.add_scalar`` writes), synchronously: no writer
  thread that dies on the first full disk, and one event file per process instead of a new one
  per retry.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)
MAX_PENDING = 100_000  # records kept in memory while a disk is full; beyond that the oldest are dropped
_EVENT_FILES = itertools.count()  # a process's event files get distinct names, as SummaryWriter's do


class Outage:
    """Log once per outage of one writer (see the module docstring)."""

    def __init__(self, what: str) -> None:
        self.what = what  # the file, for the lines
        self.active = False

    def failed(self, exc: BaseException) -> None:
        if not self.active:
            self.active = True
            log.warning("%s: not written (%s: %s); training goes on, its records wait in memory and are "
                        "written when there is room again", self.what, type(exc).__name__, exc)

    def recovered(self, written: int) -> None:
        if self.active:
            self.active = False
            log.info("%s: written again (%d record(s) caught up)", self.what, written)


class RecordAppender:
    """Append whole byte records to ``path``; records wait in memory while it cannot."""

    def __init__(self, path: Path, header: bytes = b"") -> None:
        self.path = Path(path)
        self.pending: list[bytes] = [header] if header else []  # not yet written, oldest first
        self.outage = Outage(str(self.path))
        self._fd: int | None = None

    def append(self, record: bytes) -> bool:
        """Queue ``record`` and write everything queued; False while the disk cannot take it."""
        self.pending.append(record)
        if len(self.pending) > MAX_PENDING:
            del self.pending[0]
        return self.flush()

    def flush(self) -> bool:
        written = 0
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            while self.pending:
                self._write_whole(self.pending[0])
                self.pending.pop(0)
                written += 1
        except OSError as exc:
            self.outage.failed(exc)
            return False
        self.outage.recovered(written)
        return True

    def _write_whole(self, data: bytes) -> None:
        """One record or nothing: a failed or short write is cut back to where it began."""
        start = os.fstat(self._fd).st_size
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                if n <= 0:
                    raise OSError(f"short write to {self.path}")
                view = view[n:]
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise

    def close(self) -> int:
        """A last try; returns how many records could not be written."""
        if self.pending:
            self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return len(self.pending)


class LineAppender(RecordAppender):
    """``metrics.jsonl``: one line per record."""

    def append_line(self, line: str) -> bool:
        return self.append((line.rstrip("\n") + "\n").encode())


class TensorBoardEvents:
    """One TensorBoard event file of scalars, written through a ``RecordAppender``."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto import event_pb2

        self.log_dir = Path(log_dir)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.{next(_EVENT_FILES)}"
        header = _framed([event_pb2.Event(wall_time=now, file_version="brain.Event:2")])
        self.file = RecordAppender(self.log_dir / name, header=header)

    def write(self, step: int, record: Mapping[str, Any]) -> bool:
        """The record's numbers as scalars of ``step`` (lists as ``key/i``); False while waiting."""
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = []
        for key, value in record.items():
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, x in items:
                if key != "step" and isinstance(x, (int, float)) and not isinstance(x, bool):
                    tag = key if i is None else f"{key}/{i}"
                    values.append(summary_pb2.Summary.Value(tag=tag, simple_value=float(x)))
        now = time.time()
        events = [event_pb2.Event(wall_time=now, step=step, summary=summary_pb2.Summary(value=[v])) for v in values]
        return self.file.append(_framed(events))

    def close(self) -> int:
        return self.file.close()


def _framed(events) -> bytes:
    """TensorBoard's record framing (length, CRCs) of ``events``, as one byte string."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    for event in events:
        writer.write(event.SerializeToString())
    return buffer.getvalue()
