"""Which way UCX moves KV bytes: the interface this worker's UCX listens on, and per peer
whether a READ is a same-host copy (CMA) or goes over TCP or the network.

Same-host copies go through UCX's `cma` transport (process_vm_readv, the copy runs on the
reader's thread inside `read`/`poll`), which needs ptrace permission over the peer; without it
UCX silently moves the data over TCP. `data_path` checks that with the very same syscall against
the peer's pool, and `health()` / the log say so (see cma.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from duplexkv.kv.transport import cma, meta

UCX_ENV = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_USE_MT_MUTEX", "UCX_CMA_TX_QUOTA",
           "UCX_CMA_SEG_SIZE", "UCX_PROTO_ENABLE")


@dataclass(slots=True)
class NixlPeer:
    """A connected NIXL peer, the transport's per-peer state."""

    base_ptr: int  # the peer's pool address (block b is at base_ptr + b * block_bytes)
    data_path: str  # "cma", "tcp (slow, no CMA)", "network (UCX_TLS=...)", "unknown"
    cma_error: str | None
    grants_loaded: int = 0


def ucx_env() -> dict[str, str]:
    """The UCX variables set in this process (for `health()`)."""
    return {k: os.environ[k] for k in UCX_ENV if k in os.environ}


def data_path(header: dict, cma_ok: bool, cma_reason: str) -> tuple[str, str | None]:
    """Which way UCX will move the bytes of the peer whose metadata header this is, checked
    with the real syscall: (path, why not CMA on the same host, or None)."""
    if not meta.same_host(header) or not meta.same_net_namespace(header):
        return f"network (UCX_TLS={os.environ.get('UCX_TLS', 'UCX default')})", None
    if not meta.same_pid_namespace(header):
        return "tcp (slow: peer in another PID namespace, no CMA)", "different PID namespace"
    if not cma_ok:
        return "tcp (slow: CMA disabled)", cma_reason
    err = cma.probe_read(int(header["pid"]), int(header["base_ptr"]))
    if err is not None:
        return "tcp (slow: CMA refused)", err
    return "cma", None


def point_ucx_at(host: str | None) -> str | None:
    """UCX listens on UCX_NET_DEVICES (all interfaces when unset). When the side channel
    advertises a routable address and the variable is unset, restrict UCX to that address's
    interface (the transport follows the side channel, as the TCP one does); a setting that
    excludes it (e.g. `lo` only) is a start-up error rather than a silent recompute later."""
    from duplexkv.kv import addresses

    if not host or addresses.is_loopback(host) or addresses.is_wildcard(host):
        return os.environ.get("UCX_NET_DEVICES")
    dev = addresses.interface_of(host)
    have = os.environ.get("UCX_NET_DEVICES")
    if have is None:
        if dev is not None:
            os.environ["UCX_NET_DEVICES"] = dev
        return dev
    if have != "all" and dev is not None and dev not in {d.split(":")[0] for d in have.split(",")}:
        raise addresses.KVConfigError(
            f"UCX_NET_DEVICES={have!r} excludes {dev}, the interface of the advertised side-"
            f"channel address {host!r}: NIXL peers on other hosts could not reach this worker; "
            f"unset UCX_NET_DEVICES or add {dev}")
    return have
