"""The multi-host harness (duplexkv_bench/hosts/netns.py): hosts reach each other, partitions and
links cut what they should and nothing else, shaping limits the rate, and nothing outlives the
process that built it (SIGTERM cleans up; what a SIGKILL left is removed by the next run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from duplexkv_bench.hosts.netns import Network, can_build, sh

ok, why = can_build()
pytestmark = pytest.mark.skipif(not ok, reason=why)

SERVE = """
import socket, sys
s = socket.create_server((sys.argv[1], 7000)); print("up", flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while (b := c.recv(1 << 20)):
        n += len(b)
    c.sendall(str(n).encode()); c.close()
"""
SEND = """
import socket, sys, time
t = time.perf_counter()
try:
    c = socket.create_connection((sys.argv[1], 7000), timeout=1.5)
    c.settimeout(20)
    c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR)
    print(c.recv(64).decode(), time.perf_counter() - t)
except OSError as e:
    print("unreachable", type(e).__name__)
"""


def _send(net: Network, src: str, dst: str, nbytes: int = 1000) -> str:
    return subprocess.run([*net.prefix(src), sys.executable, "-c", SEND, net.addr(dst),
                           str(nbytes)], capture_output=True, text=True, timeout=30).stdout


def _namespaces(tag: str) -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines()
            if line.startswith(tag)]


def test_partition_link_and_shape():
    with Network(["a", "b", "c"]) as net:
        for h in ("b", "c"):
            srv = net.popen(h, [sys.executable, "-c", SERVE, net.addr(h)],
                            stdout=subprocess.PIPE, text=True)
            assert srv.stdout.readline().strip() == "up"
        assert _send(net, "a", "b").startswith("1000 ")
        net.partition("a", "b")
        assert _send(net, "a", "b").startswith("unreachable")
        assert _send(net, "a", "c").startswith("1000 ")  # only a-b is cut
        net.heal("a", "b")
        assert _send(net, "a", "b").startswith("1000 ")
        net.link("c", up=False)
        assert _send(net, "a", "c").startswith("unreachable")
        assert _send(net, "a", "b").startswith("1000 ")
        net.link("c", up=True)
        net.shape("b", "20mbit")  # 2.5 MB/s: 2.5 MB take ~1 s
        n, took = _send(net, "a", "b", 2_500_000).split()
        assert n == "2500000" and 0.8 < float(took) < 5, took
        net.shape("b", None)
        n, took = _send(net, "a", "b", 2_500_000).split()
        assert float(took) < 0.5, took


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_nothing_outlives_the_builder(how):
    child = subprocess.Popen([sys.executable, "-c",
                              "from duplexkv_bench.hosts.netns import Network\n"
                              "import time, sys\n"
                              "net = Network(['a', 'b']).start()\n"
                              "net.popen('a', ['sleep', '600'])\n"
                              "print('built', flush=True); time.sleep(600)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "built"
        tag = f"dkv{child.pid}"
        assert len(_namespaces(tag)) == 2
        deadline = time.monotonic() + 20  # `ip netns exec` enters the namespace, then execs
        while not (pids := sh("ip", "netns", "pids", f"{tag}a-a").split()):
            assert time.monotonic() < deadline, "the process never entered host a"
            time.sleep(0.05)
        sleeper = int(pids[0])
        child.send_signal(getattr(signal, how))
        child.wait(20)
    finally:
        child.kill()
    if how == "SIGTERM":
        assert _namespaces(tag) == []  # cleaned up by the builder's handler
    else:
        assert len(_namespaces(tag)) == 2  # left behind ...
        with Network(["z"]):  # ... until the next run removes them
            assert _namespaces(tag) == []
    links = sh("ip", "-o", "link", "show")
    assert tag not in links
    time.sleep(0.5)
    state = open(f"/proc/{sleeper}/stat").read().split()[2] if os.path.exists(
        f"/proc/{sleeper}") else "gone"
    assert state in ("gone", "Z"), state  # the process started in a host was stopped
