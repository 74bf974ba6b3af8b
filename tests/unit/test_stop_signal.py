"""The trainer's stop flag keeps its signals when a native library takes them over below Python.

On a GPU host a trainer's first launch (fresh compile cache) had SIGUSR1 caught by a handler that
was not Python's, and Slurm's USR1 never stopped it. Here libc's ``signal`` plays that library:
it replaces the process's disposition without Python knowing, as a C library does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

from megatron_darl.loop.stop_request import RequestWatch, write_request
from megatron_darl.loop.trainer_loop import _StopFlag


def _took_over(signum: int) -> None:
    """Set ``signum`` to be ignored at the C level, as a library's own handler that drops it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    assert libc.signal(signum, ctypes.c_void_p(1)) != ctypes.c_void_p(-1).value  # SIG_IGN


def _raised(flag: _StopFlag, signum: int, within_s: float = 1.0) -> int | None:
    os.kill(os.getpid(), signum)
    end = time.monotonic() + within_s
    while flag.signum is None and time.monotonic() < end:
        time.sleep(0.01)  # Python runs its handlers in the main thread, between bytecodes
    return flag.signum


@pytest.fixture
def saved_handlers():
    before = {s: signal.getsignal(s) for s in _StopFlag.SIGNALS}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_a_native_library_took_over_reaches_the_flag_once_it_is_armed_again(saved_handlers, signum):
    flag = _StopFlag()
    _took_over(signum)
    assert signal.getsignal(signum) == flag._set  # Python still believes its handler is in place
    assert _raised(flag, signum, within_s=0.3) is None  # and the signal is lost
    flag.arm()
    assert _raised(flag, signum) == signum


def test_a_signal_lost_before_the_flag_is_armed_again_is_read_from_the_stop_request(saved_handlers, tmp_path):
    """What the launcher wrote down when it forwarded the signal stops the loop at the next step
    boundary (``requested(now=True)``), though the signal itself never reached Python."""
    flag = _StopFlag(RequestWatch(tmp_path, every_s=3600.0))
    assert flag.requested(now=True) is None
    _took_over(signal.SIGUSR1)
    write_request(tmp_path, signal.SIGUSR1)  # the launcher's side: written, then forwarded
    assert _raised(flag, signal.SIGUSR1, within_s=0.3) is None  # lost below Python
    assert flag.requested() is None  # within the watch's interval: not looked at yet
    assert flag.requested(now=True) == signal.SIGUSR1 == flag.signum
