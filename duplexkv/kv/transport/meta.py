"""Transport metadata on the wire (standard library only) and who-runs-where facts.

`pack(header, blob)` = magic + u32 length + JSON header + opaque blob (e.g. a NIXL agent blob).
Every header carries `kind`, `engine_id`, `num_blocks`, `block_bytes` and this process's
identity (`host_identity()`), so a reader can tell whether the holder runs on the same machine
and in the same PID namespace (which is when direct process-to-process copies are possible).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from functools import lru_cache

MAGIC = b"DKVT1"
_LEN = struct.Struct("!I")


class MetadataError(ValueError):
    pass


def pack(header: dict, blob: bytes = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(h)) + h + bytes(blob)


def unpack(data: bytes) -> tuple[dict, bytes]:
    data = bytes(data)
    n0 = len(MAGIC)
    if data[:n0] != MAGIC or len(data) < n0 + _LEN.size:
        raise MetadataError("not duplexkv transport metadata (bad magic)")
    (n,) = _LEN.unpack_from(data, n0)
    start = n0 + _LEN.size
    if len(data) < start + n:
        raise MetadataError("truncated transport metadata")
    try:
        header = json.loads(data[start : start + n])
    except ValueError as e:
        raise MetadataError(f"corrupt transport metadata: {e}") from None
    for key in ("kind", "engine_id", "num_blocks", "block_bytes"):
        if key not in header:
            raise MetadataError(f"transport metadata lacks {key!r}")
    return header, data[start + n :]


def check_peer(header: dict, kind: str, peer: str, block_bytes: int) -> None:
    """ValueError unless `header` describes engine `peer` of transport `kind` with our block size."""
    if header["kind"] != kind:
        raise ValueError(f"peer {peer!r} sent {header['kind']!r} transport metadata, we are {kind!r}")
    if header["engine_id"] != peer:
        raise ValueError(f"metadata is for engine {header['engine_id']!r}, not {peer!r}")
    if int(header["block_bytes"]) != block_bytes:
        raise ValueError(f"peer {peer!r} has {header['block_bytes']}-byte blocks, we have "
                         f"{block_bytes}: model, dtype or block size differ")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return ""


@lru_cache(maxsize=1)
def _static_identity() -> tuple[str, str, str]:
    return socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), _ns("pid")


def host_identity() -> dict:
    host, boot_id, pidns = _static_identity()
    return {"hostname": host, "boot_id": boot_id, "pidns": pidns, "netns": _ns("net"),
            "pid": os.getpid(), "uid": os.getuid()}


def same_net_namespace(header: dict) -> bool:
    """Same machine and same network stack (a peer in another network namespace is a host of
    its own as far as the network goes, though the kernel could still copy between us)."""
    return same_host(header) and header.get("netns", _ns("net")) == _ns("net")


def same_host(header: dict) -> bool:
    """True if the process that wrote `header` runs on this machine (same kernel boot)."""
    host, boot_id, _ = _static_identity()
    if boot_id and header.get("boot_id"):
        return header["boot_id"] == boot_id and header.get("hostname") == host
    return header.get("hostname") == host


def same_pid_namespace(header: dict) -> bool:
    _, _, pidns = _static_identity()
    return same_host(header) and bool(pidns) and header.get("pidns") == pidns
