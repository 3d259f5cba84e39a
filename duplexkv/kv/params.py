"""`kv_transfer_params`: the vLLM wire dict, typed.

A holder (P after a prefill leg, D after a finished turn) describes its retained blocks; a
reader (D on the decode leg, P on the next turn) pulls from them. Field names and shapes are
vLLM's (protocol.md 2.2) so any vLLM-compatible router can carry them opaquely.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class KVParamsError(ValueError):
    pass


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
            v = d.get(name, default)
            if v is not None and not isinstance(v, types):
                raise KVParamsError(f"kv_transfer_params.{name} has the wrong type")
            return v

        blocks = d.get("remote_block_ids") or []
        if not isinstance(blocks, list):
            raise KVParamsError("kv_transfer_params.remote_block_ids must be a list")
        if blocks and isinstance(blocks[0], list):  # one list per KV-cache group; we have one
            if len(blocks) != 1:
                raise KVParamsError("kv_transfer_params.remote_block_ids: one group expected")
            blocks = blocks[0]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
            raise KVParamsError("kv_transfer_params.remote_block_ids must hold block ids")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        port = get("remote_port", (int, str))
        try:
            port = int(port) if port is not None else None
        except ValueError:
            raise KVParamsError("kv_transfer_params.remote_port must be a port number") from None
        return cls(
            do_remote_decode=bool(get("do_remote_decode", bool, False)),
            do_remote_prefill=bool(get("do_remote_prefill", bool, False)),
            remote_block_ids=tuple(blocks),
            remote_engine_id=get("remote_engine_id", str),
            remote_request_id=get("remote_request_id", str),
            remote_host=get("remote_host", str),
            remote_port=port,
            remote_num_tokens=int(get("remote_num_tokens", int, 0) or 0),
            remote_blocks_expiry_time=get("remote_blocks_expiry_time", (int, float)),
            tp_size=int(get("tp_size", int, 1) or 1),
            first_token_id=get("first_token_id", int),
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
