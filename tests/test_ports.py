"""duplexkv.launch.ports.free_port: a port a program is told before it binds it must be one no
port-0 bind or outgoing connection takes meanwhile (CI: a vLLM decode server's NIXL side channel
found its port taken and never got ready)."""

from __future__ import annotations

import socket

from duplexkv.launch.ports import ephemeral_range, free_port


def test_the_port_is_free_and_outside_the_ephemeral_range() -> None:
    lo, hi = ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert not lo <= port <= hi, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: it binds

