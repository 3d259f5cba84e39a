"""Where the KV plane listens and what it tells peers: bind and advertised addresses.

Two listeners (the side channel; the TCP transport's block server) each have a bind address
(an interface's address, or `0.0.0.0` / `::` for all) and an advertised address (what goes into
`kv_transfer_params.remote_host` and the transport metadata, i.e. what a peer on another host
dials). The advertised address defaults to vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST`, the bind address
to the advertised one, and the transport follows the side channel unless configured otherwise
(kv/config.py resolves that). `check` refuses, at start-up, what cannot work:

    advertised 0.0.0.0 / :: / empty     no peer can dial a wildcard address
    advertised loopback, bind beyond    peers on other hosts would be told to dial themselves
    advertised beyond, bind loopback    peers on other hosts would dial a closed port
    bind address not on this host       nothing could listen there (a typo, another host's IP)

`interface_of(addr)` names the network interface that carries a local address (NIXL uses it to
point UCX at the interface the side channel advertises).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

from duplexkv.kv.config import KVConfigError

WILDCARD = ("", "0.0.0.0", "::", "[::]", "*")
FIX = ("set VLLM_NIXL_SIDE_CHANNEL_HOST (or kv_connector_extra_config.side_channel_host) to "
       "this host's address that the other workers can reach")


@dataclass(frozen=True, slots=True)
class Listen:
    """One listener: bind here, advertise that, on this port (0 = any free port)."""

    what: str  # "side channel" | "transport"
    bind_host: str
    advertise_host: str
    port: int = 0


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_wildcard(host: str) -> bool:
    ip = _ip(host)
    return host in WILDCARD or (ip is not None and ip.is_unspecified)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def _bindable(host: str) -> str | None:
    """None if a socket can bind `host` here, else why not."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"does not resolve ({e.strerror})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return "is not an address of this host"
            return e.strerror or str(e)
    return None


def check(listen: Listen) -> None:
    """KVConfigError naming the fix if `listen` cannot work (see the module's table)."""
    w, adv, bind = listen.what, listen.advertise_host, listen.bind_host
    if is_wildcard(adv):
        raise KVConfigError(f"the KV {w} would advertise {adv or 'an empty address'!r}, which no "
                            f"peer can dial; {FIX} (bind stays on all interfaces with "
                            f"{'side_channel' if w == 'side channel' else 'transfer'}_bind_host)")
    if is_loopback(adv) and not is_loopback(bind):
        raise KVConfigError(f"the KV {w} listens on {bind!r} but advertises the loopback address "
                            f"{adv!r}: workers on other hosts would dial themselves; {FIX}")
    if is_loopback(bind) and not is_loopback(adv):
        raise KVConfigError(f"the KV {w} advertises {adv!r} but listens on the loopback address "
                            f"{bind!r}, which no other host can reach; bind {adv!r} or 0.0.0.0")
    if not is_wildcard(bind):
        why = _bindable(bind)
        if why is not None:
            raise KVConfigError(f"the KV {w} cannot listen on {bind!r}: it {why}; {FIX}, or "
                                f"bind 0.0.0.0 and advertise a routable address")
    if not (0 <= listen.port <= 65535):
        raise KVConfigError(f"the KV {w} port {listen.port} is not in 0-65535")


def interface_of(host: str) -> str | None:
    """The local IPv4 interface that carries `host` (None: not found, not IPv4, or a name)."""
    ip = _ip(host)
    if ip is None or ip.version != 4:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return None
    want = ip.packed
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if raw[20:24] == want:
                return name
    return None
