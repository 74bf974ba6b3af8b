"""free_port: the ports the launcher, the trainer's local worlds and the tests start servers on."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_darl.ports import _ephemeral_low, free_port, free_port_block

REPO = Path(__file__).resolve().parents[2]


def test_free_port_is_outside_the_ephemeral_range_and_never_repeats():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if low - max(1024, low - 12000) >= 1000:
        assert all(max(1024, low - 12000) <= p < low for p in ports)
    with socket.socket() as s:  # each is bindable right after it was handed out
        s.bind(("127.0.0.1", free_port()))


def _python(code: str, *argv: str, stdin=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *argv], cwd=REPO, text=True, stdin=stdin,
                            stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))


def _printed_ports(proc: subprocess.Popen) -> set[int]:
    return set(json.loads(proc.stdout.readline()))


def test_a_port_a_live_process_drew_is_never_drawn_by_another_and_is_free_once_it_exits():
    """Two launchers starting at once (a study's runs) must not draw one port: 400 ports held by
    a live process against 3,000 drawn by another (drawn at random alone, ~100 would meet), and
    the holder's reservations end with it."""
    low = _ephemeral_low()
    if low - max(1024, low - 12000) < 5000:
        pytest.skip("the ephemeral range starts too low to leave room for 3,400 ports")
    holder = _python("import json, sys\nfrom megatron_darl.ports import free_port\n"
                     "print(json.dumps([free_port() for _ in range(400)]), flush=True)\n"
                     "sys.stdin.read()", stdin=subprocess.PIPE)
    try:
        held = _printed_ports(holder)
        drawer = _python("import json\nfrom megatron_darl.ports import free_port\n"
                         "print(json.dumps([free_port() for _ in range(3000)]), flush=True)")
        drawn = _printed_ports(drawer)
        assert drawer.wait(timeout=60) == 0
        assert len(held) == 400 and len(drawn) == 3000
        assert not held & drawn
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    checker = _python("import json, sys\nfrom megatron_darl.ports import _reserve\n"
                      "print(json.dumps([p for p in json.loads(sys.argv[1]) if _reserve(p)]))",
                      json.dumps(sorted(held)))
    assert _printed_ports(checker) == held
    assert checker.wait(timeout=60) == 0


def test_a_block_is_consecutive_bindable_below_the_ephemeral_range_and_reserved_against_others():
    """Emulated Slurm nodes listen on a range of ports: every port of a block must be free,
    outside the ephemeral range, and held against other processes for this process's life."""
    low = _ephemeral_low()
    if low - max(1024, low - 12000) < 1000:
        pytest.skip("the ephemeral range starts too low to leave room for a block")
    base = free_port_block(8, "0.0.0.0")
    block = list(range(base, base + 8))
    assert max(1024, low - 12000) <= base and block[-1] < low
    for port in block:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
    assert not set(block) & {free_port() for _ in range(200)}
    checker = _python("import json, sys\nfrom megatron_darl.ports import _reserve\n"
                      "print(json.dumps([p for p in json.loads(sys.argv[1]) if _reserve(p)]))",
                      json.dumps(block))
    assert _printed_ports(checker) == set()
