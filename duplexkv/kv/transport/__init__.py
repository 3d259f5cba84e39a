"""KV-block transports: NIXL (UCX) first, built-in TCP second, behind `KVTransport`."""

from duplexkv.kv.transport.base import (
                                        KVTransport,
                                        TransferStats,
                                        XferHandle,
                                        XferState,
                                        make_transport,
)

__all__ = ["KVTransport", "TransferStats", "XferHandle", "XferState", "make_transport"]
