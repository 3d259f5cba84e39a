"""KV-block transports behind `KVTransport`: NIXL (UCX) and the built-in TCP one.

`make_transport(kind, **kw)` is the only place that knows the implementations; they import
`base` (and its parts) and never this package's top level, so there is no import circle.
"""

from duplexkv.kv.transport.base import NIXL_INSTALL_HINT, KVTransport
from duplexkv.kv.transport.handle import XferHandle, XferState

__all__ = ["KVTransport", "XferHandle", "XferState", "make_transport"]


def make_transport(kind: str, **kw) -> KVTransport:
    """Create a transport: kind "nixl" (NIXL with the UCX backend) or "tcp" (built in).

    Keyword arguments go to the implementation (`engine_id`, `timeout_s`, `host`, ...).
    """
    if kind == "tcp":
        from duplexkv.kv.transport.tcp import TcpTransport

        return TcpTransport(**kw)
    if kind == "nixl":
        try:
            import nixl  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                f"the nixl transport needs NIXL, which is not importable ({e}). Install it after "
                f"torch, without dependencies so that no CUDA torch is pulled in: "
                f"`{NIXL_INSTALL_HINT}`; or use the built-in transport "
                f"(kv_connector \"TcpConnector\")") from e
        from duplexkv.kv.transport.nixl import NixlTransport

        return NixlTransport(**kw)
    raise ValueError(f"unknown KV transport {kind!r}; use 'nixl' or 'tcp'")
