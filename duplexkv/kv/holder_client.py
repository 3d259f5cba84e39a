"""The reader's side-channel client: what it asks a holder, on the kv-net threads.

    peer      the holder's handshake, once per (engine id, side-channel address) and checked:
              the engine id the params name (a restarted holder is another engine), the
              compatibility hash (same KV layout and model) and the transport
    verify    which leading tokens of the prompt the holder has (and its claim on them); the
              round trip is a sample of the link's RTT (link_model.py)
    heartbeat renew the holder's lease while a READ runs
Requests go over kept, authenticated sockets (`side_channel.ClientPool`: the CURVE handshake is
paid once per socket). Each call returns whether the peer behaved, for its breaker (peer_gate.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from duplexkv.kv import messages as m
from duplexkv.kv import side_channel
from duplexkv.kv.auth import KVAuth
from duplexkv.kv.config import KVTransferConfig
from duplexkv.kv.link_model import LinkModel
from duplexkv.wire.kv_params import KVTransferParams

log = logging.getLogger(__name__)
MAX_PEERS = 1024


@dataclass(frozen=True, slots=True)
class Verified:
    """A verify's outcome, handed from a kv-net thread to the engine thread."""

    request_id: str
    info: side_channel.PeerInfo | None
    reply: m.VerifyReply | None
    why: str | None = None  # set when the verify itself failed
    error: str | None = None


def address(p: KVTransferParams) -> str:
    """The holder's side-channel address the params name."""
    return f"{p.remote_host}:{p.remote_port}"


class HolderClient:
    def __init__(self, cfg: KVTransferConfig, compat_hash: str, auth: KVAuth,
                 link: LinkModel) -> None:
        self.cfg, self.compat_hash, self.link = cfg, compat_hash, link
        # handshakes by (engine id, side-channel address): the same id elsewhere is asked again
        self._peers: dict[tuple[str, str], side_channel.PeerInfo] = {}
        self._peers_lock = threading.Lock()  # kv-net threads handshake concurrently
        # kept, authenticated side-channel sockets: the CURVE handshake is paid once per socket
        self._side = side_channel.ClientPool(auth)

    def _peer(self, p: KVTransferParams) -> side_channel.PeerInfo:
        key = (p.remote_engine_id or "", address(p))
        info = self._peers.get(key)
        if info is None:
            info = side_channel.handshake(p.remote_host or "", p.remote_port or 0,
                                          self.cfg.connect_timeout_s, pool=self._side)
            hs = info.handshake
            if hs.engine_id != p.remote_engine_id:
                raise side_channel.SideChannelError(
                    f"engine id mismatch: params name {p.remote_engine_id}, "
                    f"{address(p)} is {hs.engine_id} (restarted?)")
            if self.cfg.enforce_handshake_compat and hs.compat_hash != self.compat_hash:
                raise side_channel.SideChannelError(
                    f"incompatible KV layout or model at {hs.engine_id}: compatibility hash "
                    f"{hs.compat_hash[:12]} != ours {self.compat_hash[:12]}")
            if hs.transport != self.cfg.transport:
                raise side_channel.SideChannelError(
                    f"peer uses transport {hs.transport}, we use {self.cfg.transport}")
            with self._peers_lock:
                if len(self._peers) >= MAX_PEERS:
                    self._peers.pop(next(iter(self._peers)))
                self._peers[key] = info
        return info

    def verify(self, rid: str, p: KVTransferParams, hashes: list,
               tokens: list, tag: bytes = b"") -> tuple[Verified, bool]:
        """Handshake (first time) and verify. -> (the outcome, whether the peer behaved)."""
        try:
            info = self._peer(p)
            t0 = time.perf_counter()
            reply = self._side.request(p.remote_host or "", p.remote_port or 0,
                                       m.Verify(p.remote_request_id or "", hashes, tokens, tag),
                                       m.VerifyReply, self.cfg.connect_timeout_s)
            assert isinstance(reply, m.VerifyReply)
            self.link.observe_rtt(p.remote_engine_id or "", (time.perf_counter() - t0) * 1e3)
            return Verified(rid, info, reply), True
        except side_channel.BadReply as e:
            return Verified(rid, None, None, "bad_reply", str(e)), False
        except side_channel.PeerUnreachable as e:
            return Verified(rid, None, None, "unreachable", str(e)), False
        except Exception as e:  # it answered (refused, or is another engine): not a dead peer
            return Verified(rid, None, None, "failed", str(e)), True

    def heartbeat(self, p: KVTransferParams) -> bool:
        try:
            self._side.request(p.remote_host or "", p.remote_port or 0,
                               m.Heartbeat([p.remote_request_id or ""]), m.HeartbeatReply,
                               self.cfg.connect_timeout_s)
            return True
        except Exception as e:
            log.warning("heartbeat to %s failed: %s", p.remote_engine_id, e)
            return not isinstance(e, (side_channel.BadReply, side_channel.PeerUnreachable))

    def num_peers(self) -> int:
        return len(self._peers)

    def sockets(self) -> dict:
        return {"opened": self._side.opened, "idle": self._side.idle()}

    def close(self) -> None:
        self._side.close()
