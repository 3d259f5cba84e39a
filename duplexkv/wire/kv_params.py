"""`kv_transfer_params`, typed: vLLM's wire dict as `KVTransferParams`, and the two payloads a router
sends a prefill leg (protocol.md 2.7).

A holder (P after a prefill leg, D after a finished turn) describes its retained blocks with one; a
reader (D on the decode leg, P on the next turn) pulls from them. Field names and shapes are
vLLM's (docs/protocol.md) so any vLLM-compatible router carries them opaquely. Parsed at the HTTP
edge and carried as this type down to the connector.

    miss_params()          a P leg with nothing to pull: "compute the prompt, keep it for D"
    replay_params(d)       D's stored params handed to P on the next turn (booleans forced)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_BLOCK_IDS = 1 << 20
MAX_NAME_CHARS = 256


class KVParamsError(ValueError):
    pass


def _finite(v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise KVParamsError("kv_transfer_params.remote_blocks_expiry_time must be finite")
    return v


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_block_ids: tuple[int, ...] = ()
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int = 0
    remote_blocks_expiry_time: float | None = None
    tp_size: int = 1
    # duplexkv's extension: the holder's greedy first token after these tokens (P's answer to
    # its prefill leg), so a greedy reader can emit it instead of recomputing the last prompt
    # token; absent from vLLM's dicts, ignored by vLLM readers
    first_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # unknown keys, passed through untouched

    @property
    def has_remote_blocks(self) -> bool:
        """Enough to pull from: blocks, a holder id, request id and side-channel address."""
        return bool(self.remote_block_ids and self.remote_engine_id and self.remote_request_id
                    and self.remote_host and self.remote_port and self.remote_num_tokens > 0)

    @classmethod
    def from_dict(cls, d: object) -> "KVTransferParams":
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise KVParamsError("kv_transfer_params must be an object")

        def get(name, types, default=None):
            types = types if isinstance(types, tuple) else (types,)
            v = d.get(name, default)
            if v is not None and (not isinstance(v, types)
                                  or (isinstance(v, bool) and bool not in types)):
                raise KVParamsError(f"kv_transfer_params.{name} has the wrong type")
            if isinstance(v, str) and len(v) > MAX_NAME_CHARS:
                raise KVParamsError(f"kv_transfer_params.{name} is too long")
            return v

        def count(name: str, default: int) -> int:
            v = get(name, int, default)
            v = default if v is None else v
            if not 0 <= v < 1 << 31:
                raise KVParamsError(f"kv_transfer_params.{name} is out of range")
            return v

        blocks = d.get("remote_block_ids") or []
        if not isinstance(blocks, list):
            raise KVParamsError("kv_transfer_params.remote_block_ids must be a list")
        if blocks and isinstance(blocks[0], list):  # one list per KV-cache group; we have one
            if len(blocks) != 1:
                raise KVParamsError("kv_transfer_params.remote_block_ids: one group expected")
            blocks = blocks[0]
        if len(blocks) > MAX_BLOCK_IDS or not all(
                isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 1 << 31
                for b in blocks):
            raise KVParamsError("kv_transfer_params.remote_block_ids must hold block ids")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        port = get("remote_port", (int, str))
        try:
            port = int(port) if port is not None else None
        except ValueError:
            raise KVParamsError("kv_transfer_params.remote_port must be a port number") from None
        if port is not None and not 0 < port < 65536:
            raise KVParamsError("kv_transfer_params.remote_port must be a port number")
        first = get("first_token_id", int)
        if first is not None and not 0 <= first < 1 << 31:
            raise KVParamsError("kv_transfer_params.first_token_id is out of range")
        return cls(
            do_remote_decode=bool(get("do_remote_decode", bool, False)),
            do_remote_prefill=bool(get("do_remote_prefill", bool, False)),
            remote_block_ids=tuple(blocks),
            remote_engine_id=get("remote_engine_id", str),
            remote_request_id=get("remote_request_id", str),
            remote_host=get("remote_host", str),
            remote_port=port,
            remote_num_tokens=count("remote_num_tokens", 0),
            remote_blocks_expiry_time=_finite(get("remote_blocks_expiry_time", (int, float))),
            tp_size=count("tp_size", 1) or 1,
            first_token_id=first,
            extra={k: v for k, v in d.items() if k not in known and not k.startswith("_")},
        )

    def to_dict(self) -> dict:
        return {
            **self.extra,
            "do_remote_decode": self.do_remote_decode,
            "do_remote_prefill": self.do_remote_prefill,
            "remote_block_ids": [list(self.remote_block_ids)],
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_num_tokens": self.remote_num_tokens,
            "remote_blocks_expiry_time": self.remote_blocks_expiry_time,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "transfer_mode": "pull",
            **({"first_token_id": self.first_token_id} if self.first_token_id is not None
               else {}),
        }


MISS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}


def miss_params() -> dict:
    """A prefill leg's params when there is nothing to pull: P computes and keeps the prompt."""
    return dict(MISS)


def replay_params(d_params: dict) -> dict:
    """D's stored params as a P request (protocol.md 2.7): booleans forced, engine-internal keys
    (`_remote_blocks_processed`, ...) never sent."""
    out = {k: v for k, v in d_params.items() if not k.startswith("_")}
    out.update(do_remote_decode=True, do_remote_prefill=False)
    return out
