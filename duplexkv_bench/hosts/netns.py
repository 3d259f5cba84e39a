"""Hosts of their own on one Linux machine: network namespaces on a bridge (needs root).

    with Network(["router", "p0", "d0"]) as net:     # 10.213.X.1, .2, .3 on a bridge
        net.shape("d0", "1gbit")                      # tc tbf on d0's link, both directions
        net.partition("p0", "d0"); net.heal("p0", "d0")  # blackhole routes on both sides
        net.link("d0", up=False)                      # d0's cable pulled
        proc = net.popen("p0", ["python", ...])       # a process in p0's network stack

Each host is a namespace `dkv<pid><k>-<name>` (k: a letter per network of the process) whose
`eth0` is one end of a veth pair; the other end (`dkv<pid><k>v<i>`) is a port of the bridge
`dkv<pid><k>br`. The subnet is 10.213.X.0/24 with X
chosen so that it overlaps nothing this machine already routes; the creating (root) namespace
gets `.254` on the bridge so that the caller can reach every host, which the hosts' own
addresses `.1`, `.2`, ... are the only other members of. No traffic goes anywhere else.

Clean-up always happens: `close()` (the context manager, `atexit`, and SIGTERM / SIGHUP
handlers) stops the processes started in the hosts and deletes the namespaces and the bridge;
a new Network first removes those of earlier runs whose creating process is gone (a crash or
SIGKILL). The pid in every name is what tells a stale object from a live one.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass, field

PREFIX = "dkv"
SUBNET_BASE = "10.213"
_NAME = re.compile(rf"^{PREFIX}(\d+)[a-z](?:-|br$|[vp]\d+$)")
_live: list[Network] = []
_lock = threading.Lock()
_handlers_installed = False
_made = 0  # networks made by this process: a letter in the names tells them apart


class HostsError(RuntimeError):
    pass


def can_build() -> tuple[bool, str]:
    """(True, "") if this process may build hosts, else (False, why)."""
    if os.geteuid() != 0:
        return False, "building network namespaces needs root (CI runs as root)"
    for tool in ("/usr/sbin/ip", "/usr/sbin/tc"):
        if not os.path.exists(tool) and not os.path.exists(tool.replace("/usr/sbin", "/sbin")):
            return False, f"{os.path.basename(tool)} (iproute2) is not installed"
    return True, ""


def sh(*argv: str, check: bool = True, ns: str | None = None) -> str:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise HostsError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def _pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def remove_stale() -> list[str]:
    """Delete namespaces and links of earlier runs whose creating process has exited (and the
    processes left in those namespaces). Returns what was removed."""
    removed = []
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_ns_processes(name)
            for link in sh("ip", "-o", "link", "show", check=False, ns=name).splitlines():
                if " eth0@" in link:  # the veth pair goes at once with its end
                    sh("ip", "link", "del", "eth0", check=False, ns=name)
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in sh("ip", "-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            sh("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def _kill_ns_processes(ns: str) -> None:
    for pid in sh("ip", "netns", "pids", ns, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _free_subnet() -> int:
    """A third octet X such that 10.213.X.0/24 overlaps no address or route of this machine."""
    used = sh("ip", "-o", "-4", "addr", "show", check=False) + sh("ip", "-4", "route", "show",
                                                                   "table", "all", check=False)
    nets = []
    for tok in re.findall(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", used):
        try:
            nets.append(ipaddress.ip_network(tok, strict=False))
        except ValueError:
            pass
    start = os.getpid() % 200 + 20
    for i in range(230):
        x = (start + i) % 230 + 20
        cand = ipaddress.ip_network(f"{SUBNET_BASE}.{x}.0/24")
        if not any(cand.overlaps(n) and n.prefixlen > 0 for n in nets):
            return x
    raise HostsError(f"no free /24 in {SUBNET_BASE}.0.0/16")


def _burst(rate: str) -> str:
    """tbf's bucket: 4 ms worth of the rate (a 250 Hz timer), at least 64 KiB."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.lower())
    if not m:
        raise HostsError(f"rate {rate!r}: use e.g. 100mbit, 1gbit, 10gbit")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return str(max(65536, int(bits / 8 / 250)))


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    ns: str  # the network namespace
    addr: str  # eth0's address inside it
    link: str  # the veth end on the bridge (in the creating namespace)


@dataclass
class Network:
    """N hosts on one bridge; see the module docstring. Use as a context manager."""

    names: list[str]
    hosts: dict[str, Host] = field(default_factory=dict, init=False)
    bridge: str = field(default="", init=False)
    gateway: str = field(default="", init=False)  # the creating namespace's address
    procs: list[subprocess.Popen] = field(default_factory=list, init=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names) or not 1 <= len(self.names) <= 250:
            raise ValueError("host names must be distinct, 1 to 250 of them")
        for n in self.names:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", n):
                raise ValueError(f"host name {n!r}: lower-case letters and digits, <= 10")

    # building and tearing down ---------------------------------------------------------
    def start(self) -> Network:
        ok, why = can_build()
        if not ok:
            raise HostsError(why)
        _install_handlers()
        remove_stale()
        with _lock:
            _live.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        global _made
        with _lock:
            tag = f"{PREFIX}{os.getpid()}{chr(97 + _made % 26)}"
            _made += 1
        x = _free_subnet()
        self.bridge = f"{tag}br"
        self.gateway = f"{SUBNET_BASE}.{x}.254"
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, link, addr = f"{tag}-{name}", f"{tag}v{i}", f"{SUBNET_BASE}.{x}.{i + 1}"
            sh("ip", "netns", "add", ns)
            self.hosts[name] = Host(name, ns, addr, link)
            sh("ip", "link", "add", link, "type", "veth", "peer", "name", f"{tag}p{i}")
            sh("ip", "link", "set", f"{tag}p{i}", "netns", ns)
            sh("ip", "link", "set", f"{tag}p{i}", "name", "eth0", ns=ns)
            sh("ip", "addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            sh("ip", "link", "set", "eth0", "up", ns=ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            sh("ip", "link", "set", link, "master", self.bridge)
            sh("ip", "link", "set", link, "up")

    def close(self) -> None:
        """Stop the hosts' processes, delete the namespaces and the bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for h in self.hosts.values():
            _kill_ns_processes(h.ns)
            sh("ip", "link", "del", h.link, check=False)  # at once; with the namespace: lazily
            sh("ip", "netns", "del", h.ns, check=False)
        if self.bridge:
            sh("ip", "link", "del", self.bridge, check=False)
        with _lock:
            if self in _live:
                _live.remove(self)

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # the links -------------------------------------------------------------------------
    def addr(self, name: str) -> str:
        return self.hosts[name].addr

    def shape(self, name: str, rate: str | None) -> None:
        """Limit `name`'s link to `rate` in both directions (tc tbf); None removes the limit."""
        h = self.hosts[name]
        for dev, ns in ((h.link, None), ("eth0", h.ns)):
            if rate is None:
                sh("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
            else:
                sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", _burst(rate), "latency", "50ms", ns=ns)

    def link(self, name: str, up: bool) -> None:
        """Take `name`'s link down (nothing reaches it or leaves it) or bring it back."""
        sh("ip", "link", "set", self.hosts[name].link, "up" if up else "down")

    def partition(self, a: str, b: str) -> None:
        """Cut `a` from `b` only (packets between them vanish; everyone else still talks)."""
        for x, y in ((a, b), (b, a)):
            sh("ip", "route", "replace", "blackhole", f"{self.addr(y)}/32", ns=self.hosts[x].ns)

    def heal(self, a: str, b: str) -> None:
        for x, y in ((a, b), (b, a)):
            sh("ip", "route", "del", "blackhole", f"{self.addr(y)}/32", check=False,
               ns=self.hosts[x].ns)

    # processes -------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """SIGKILL every process of host `name` (its kernel stays: connections are refused)."""
        _kill_ns_processes(self.hosts[name].ns)
    def prefix(self, name: str) -> tuple[str, ...]:
        """The command prefix that runs a program in `name`'s network stack."""
        return ("ip", "netns", "exec", self.hosts[name].ns)

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start `argv` in host `name` (stopped by `close`). Popen keywords pass through."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen([*self.prefix(name), *argv], **kw)
        self.procs.append(p)
        return p

    def adopt(self, proc: subprocess.Popen) -> None:
        """Have `close` stop a process started some other way in one of the hosts."""
        self.procs.append(proc)


def close_all() -> None:
    with _lock:
        nets = list(_live)
    for net in nets:
        net.close()


def _on_signal(signum, frame) -> None:
    close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """atexit always; SIGTERM / SIGHUP only from the main thread and where nobody else handles
    them (Ctrl-C raises KeyboardInterrupt, which runs the context manager and atexit)."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _on_signal)
