"""TCP ports for the servers a run starts (control store, torch.distributed rendezvous).

A neutral helper: the launcher, the trainer's local gloo worlds, the tests and the benchmarks all
need a port that is free now and will still be free a few seconds later, and none of them should
import the transport (or the trainer) for it.

"Free now" is not enough when several runs start on one host at once (a study's 22 runs, two
jobs on a node): a port is only checked bindable, and the server that uses it listens seconds
later, so a second launcher could draw the same port meanwhile and the two runs would meet on
one control store. Each port handed out is therefore also reserved, host-wide, for the life of
the process that drew it: a one-byte POSIX lock at the port's offset of one shared file. The
kernel drops a process's locks when it exits (even on SIGKILL), so no reservation outlives its
holder and nothing needs cleaning up.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

_HANDED_OUT: set[int] = set()  # ports free_port gave this process, never given twice
_REGISTRY_NAME = "megatron_darl.ports"
_registry_fd: int | None = None  # opened once and never closed: closing it would drop every lock


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux default


def _registry() -> int | None:
    """The host's reservation file (in /tmp, whatever $TMPDIR says: a Slurm job's own TMPDIR
    would hide one job's reservations from the next), or None where it cannot be opened."""
    global _registry_fd
    if _registry_fd is None:
        path = Path("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()) / _REGISTRY_NAME
        try:
            _registry_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            _registry_fd = -1
        else:
            try:
                os.fchmod(_registry_fd, 0o666)  # other users' runs on the host reserve here too
            except OSError:
                pass  # not ours: its owner made it shared
    return None if _registry_fd < 0 else _registry_fd


def _reserve(port: int) -> bool:
    """Reserve ``port`` for this process; False while another live process holds it."""
    fd = _registry()
    if fd is None:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False
    return True


def _release(port: int) -> None:
    fd = _registry()
    if fd is not None:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port for a server that will listen on ``host`` a few seconds from now.

    ``bind(port 0)`` hands out a port from the kernel's ephemeral range, and any outgoing
    connection on the machine may take that port as its local end before the server (a process
    still importing torch) listens on it: EADDRINUSE, seen in CI. So the port is drawn at random
    (from the OS, not the seeded ``random`` module, so that processes do not draw alike) from
    the 12,000 ports below the ephemeral range, which outgoing connections never use. It is
    reserved host-wide for this process's life (no other process of ours draws it meanwhile),
    checked bindable now, and never handed out twice by this process. Where the ephemeral range
    starts too low to leave room, it falls back to port 0.
    """
    return free_port_block(1, host)


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports, each one as :func:`free_port` hands it out
    (daemons that number their ports from a base, such as emulated Slurm nodes, need a range).
    """
    low = _ephemeral_low()
    first = max(1024, low - 12000)
    rng = random.SystemRandom()
    for _ in range(200 if low - first >= 1000 + count else 0):
        base = rng.randrange(first, low - count + 1)
        if _take(range(base, base + count), host):
            return base
    if count > 1:
        raise RuntimeError(f"no {count} consecutive free ports below the ephemeral range "
                           f"({first}-{low - 1}) after 200 draws")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    _reserve(port)
    _HANDED_OUT.add(port)
    return port


def _take(ports: range, host: str) -> bool:
    """Reserve every port of ``ports`` and check each bindable on ``host``; on any refusal give
    back what was reserved and return False."""
    taken: list[int] = []
    for port in ports:
        if port in _HANDED_OUT or not _reserve(port):
            break
        taken.append(port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                break
    else:
        _HANDED_OUT.update(ports)
        return True
    for port in taken:
        _release(port)
    return False
