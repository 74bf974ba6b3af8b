"""The verdict of a function check, computed where the program cannot reach.

A check run in the program's own interpreter, scored by its exit code, would give 1.0 to a wrong
solution that called ``sys.exit(0)``/``os._exit(0)`` or registered an atexit hook before the
asserts. So the trusted test and the untrusted program are two processes of the sandbox:

- the **harness** (the sandbox's PID 1, ``run_check``) executes the record's trusted code (the
  prompt, whose helper functions tests may use, and the ``check`` function) and calls
  ``check(candidate)`` with a *proxy*, also bound to the entry point's name (some tests call the
  function by name): each call is sent to the program's process as JSON and the returned value
  comes back as JSON, decoded into plain Python values by the harness. The verdict is
  "``check`` returned without raising", written by the harness on a pipe to the parent that the
  program never holds;
- the **program** (``serve``) runs the model's code as ``__main__``, then answers calls to its
  entry point until the harness is done.

Whatever the program does to itself (exit early with any code, atexit hooks, print fake
verdicts, close its descriptors, return objects whose ``__eq__`` always says yes, patch
builtins), the harness sees only well-formed plain values or no answer, and no answer is a fail.
The kernel keeps the program away from the harness (see ``sandbox_boot``).

Values cross as JSON with tags for what JSON lacks: tuples, sets, frozensets, dicts with any
keys, bytes, complex; floats keep inf and nan. Anything else (a generator, an object) is refused
and fails the call. Stdlib only: imported inside the sandbox.
"""

from __future__ import annotations

import builtins
import json
import os
import select
import sys
import time

MAX_MESSAGE_BYTES = 16 << 20  # one call's arguments or result
_TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}


def encode(value, depth: int = 0):
    """Plain Python value -> JSON-able structure (TypeError for anything else)."""
    if depth > 200:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise TypeError(f"a {kind.__name__} cannot cross the sandbox boundary")


def decode(obj):
    """Inverse of ``encode``; builds only plain built-in values (ValueError on anything else)."""
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is list:
        return [decode(v) for v in obj]
    if type(obj) is not dict or len(obj) != 1:
        raise ValueError("malformed value")
    (tag, body), = obj.items()
    if tag in _TAGS and type(body) is list:
        return _TAGS[tag](decode(v) for v in body)
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {decode(k): decode(v) for k, v in body}
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2:
        return complex(float(body[0]), float(body[1]))
    raise ValueError(f"unknown tag {tag!r}")


class CandidateError(Exception):
    """The program's function raised something that is not a built-in exception, or gave no
    usable answer."""


class Channel:
    """Newline-framed JSON messages over two pipe fds, every read under a deadline."""

    def __init__(self, read_fd: int, write_fd: int, deadline: float) -> None:
        self.read_fd, self.write_fd, self.deadline = read_fd, write_fd, deadline
        self.buffer = bytearray()
        os.set_blocking(write_fd, False)  # a full pipe must not outlast the deadline

    def send(self, message) -> None:
        data = memoryview(json.dumps(message).encode() + b"\n")
        while data:
            _, ready, _ = select.select([], [self.write_fd], [], self._remaining())
            if not ready:
                raise TimeoutError("the program stopped reading calls")
            try:
                data = data[os.write(self.write_fd, data[: 1 << 16]):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise CandidateError("the program exited before answering") from None

    def receive(self):
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.read_fd], [], [], self._remaining())
            if not ready:
                raise TimeoutError("the program did not answer in time")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise CandidateError("the program exited before answering")
            self.buffer += chunk
            if len(self.buffer) > MAX_MESSAGE_BYTES:
                raise CandidateError("the program's answer is too large")
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        return json.loads(line)

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the sandbox's time is up")
        return left


def _raise_from(error: dict) -> None:
    """Re-raise the program's exception: the same built-in class when it is one (tests may
    expect a ValueError), else CandidateError."""
    name, message = str(error.get("type", "")), str(error.get("message", ""))[:2000]
    cls = _BUILTIN_EXCEPTIONS.get(name)
    try:
        exc = cls(message) if cls is not None else CandidateError(f"{name}: {message}")
    except TypeError:  # e.g. UnicodeDecodeError needs five arguments
        exc = CandidateError(f"{name}: {message}")
    raise exc


_BUILTIN_EXCEPTIONS = {
    name: obj for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, Exception)
}


def run_check(setup: str, test: str, entry_point: str, channel: Channel) -> tuple[bool, str, bool]:
    """Run the trusted ``setup`` and ``test`` code and ``check(proxy)``.

    Returns (passed, why not, broken): ``broken`` when the trusted code itself failed before
    ``check`` could call the program (it does not compile, raises, defines no ``check``): a
    verdict on the row, not on the answer.
    """

    def candidate(*args, **kwargs):
        channel.send({"args": encode(list(args)), "kwargs": encode(kwargs)})
        reply = channel.receive()
        if type(reply) is not dict:
            raise CandidateError("malformed answer")
        if "error" in reply:
            _raise_from(reply["error"] if type(reply["error"]) is dict else {})
        return decode(reply.get("value"))

    candidate.__name__ = entry_point
    namespace = {"__name__": "__check__"}
    try:
        exec(compile(setup, "<prompt>", "exec"), namespace)
        namespace[entry_point] = candidate  # tests may call it by name (HumanEval/33 does)
        exec(compile(test, "<test>", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - the row's own code failed: no verdict on the answer
        return False, "the check's own code failed: " + _traceback(), True
    if not callable(namespace.get("check")):
        return False, "the test code defines no check(candidate)", True
    try:
        namespace["check"](candidate)
    except BaseException:  # noqa: BLE001 - any failure of the trusted check is a fail verdict
        return False, _traceback(), False
    return True, "", False


def _traceback() -> str:
    import traceback

    return traceback.format_exc(limit=-3)[-2000:]


def serve(namespace: dict, entry_point: str, read_fd: int, write_fd: int) -> None:
    """Program side: answer the harness's calls of ``namespace[entry_point]`` until EOF."""
    reader = os.fdopen(read_fd, "rb", buffering=1 << 16)
    writer = os.fdopen(write_fd, "wb", buffering=0)
    for line in reader:
        try:
            request = json.loads(line)
            fn = namespace[entry_point]
            value = fn(*decode(request["args"]), **decode(request["kwargs"]))
            reply = {"value": encode(value)}
        except Exception as exc:  # noqa: BLE001 - reported to the harness, which judges it
            reply = {"error": {"type": type(exc).__name__, "message": str(exc)[:2000]}}
        try:
            data = json.dumps(reply).encode()
        except (TypeError, ValueError) as exc:
            data = json.dumps({"error": {"type": "TypeError", "message": str(exc)}}).encode()
        writer.write(data + b"\n")
    sys.stdout.flush()
