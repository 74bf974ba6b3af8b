"""free_port: the ports the launcher, the trainer's local worlds and the tests start servers on."""

import socket

from megatron_darl.ports import _ephemeral_low, free_port


def test_free_port_is_outside_the_ephemeral_range_and_never_repeats():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if low - max(1024, low - 12000) >= 1000:
        assert all(max(1024, low - 12000) <= p < low for p in ports)
    with socket.socket() as s:  # each is bindable right after it was handed out
        s.bind(("127.0.0.1", free_port()))
