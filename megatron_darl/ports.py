"""TCP ports for the servers a run starts (control store, torch.distributed rendezvous).

A neutral helper: the launcher, the trainer's local gloo worlds, the tests and the benchmarks all
need a port that is free now and will still be free a few seconds later, and none of them should
import the transport (or the trainer) for it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_HANDED_OUT: set[int] = set()  # ports free_port gave this process, never given twice


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port for a server that will listen on ``host`` a few seconds from now.

    ``bind(port 0)`` hands out a port from the kernel's ephemeral range, and any outgoing
    connection on the machine may take that port as its local end before the server (a process
    still importing torch) listens on it: EADDRINUSE, seen in CI. So the port is drawn at random
    (from the OS, not the seeded ``random`` module, so that processes do not draw alike) from
    the 12,000 ports below the ephemeral range, which outgoing connections never use, checked
    bindable now, and never handed out twice by this process. Where the ephemeral range starts
    too low to leave room, it falls back to port 0.
    """
    low = _ephemeral_low()
    first = max(1024, low - 12000)
    rng = random.SystemRandom()
    for _ in range(200 if low - first >= 1000 else 0):
        port = rng.randrange(first, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    _HANDED_OUT.add(port)
    return port
