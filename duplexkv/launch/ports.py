"""A free loopback port for a program that must be told its port before it starts (vLLM's servers
and NIXL side channels, a Redis server in a test): the launcher's own processes bind port 0
themselves and say which port they got.

The port is drawn at random below or above the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range). A port the kernel handed out for port 0 is one it hands
out again meanwhile — to another program's port-0 bind (vLLM's internal sockets bind port 0) or to
an outgoing connection — so between this call and the program's own bind it may be taken; CI saw
a vLLM decode server's NIXL side channel fail so ("Address already in use") and the server never
get ready. Outside that range only another explicit choice can take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: well-known and registered services' ports


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = map(int, RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` nothing listens on now, outside the ephemeral range (see above)."""
    lo, hi = ephemeral_range()
    ports = [p for p in range(LOWEST, 65536) if not lo <= p <= hi]
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} outside the ephemeral range {lo}-{hi}")
