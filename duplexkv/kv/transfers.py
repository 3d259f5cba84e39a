"""The reader's READs through the transport, on the engine thread.

A holder's transport is connected once per engine id, with the metadata its handshake carried.
A pull's READ carries the claim's token (and NIXL's grant) and, as its notification, `done:`
with that token; a declined pull sends the notify-only `skip:` so the holder frees at once. A
READ whose request went away (aborted, or its handling failed) may still land: its blocks stay
pinned until the transport says it ended (`orphan`, `poll_orphans`).
"""

from __future__ import annotations

import logging

from duplexkv.engine.kv_transfer import EngineHost
from duplexkv.kv import side_channel
from duplexkv.kv.holder import notif
from duplexkv.kv.transport import KVTransport, XferHandle, XferState
from duplexkv.wire.kv_params import KVTransferParams

log = logging.getLogger(__name__)


class Transfers:
    def __init__(self, transport: KVTransport, host: EngineHost) -> None:
        self.transport, self.host = transport, host
        self._connected: set[str] = set()
        self._orphans: list[tuple[XferHandle, list[int]]] = []  # aborted READs still landing

    def _connect(self, p: KVTransferParams, info: side_channel.PeerInfo) -> None:
        if p.remote_engine_id not in self._connected:
            self.transport.connect(p.remote_engine_id or "", info.handshake.transport_metadata)
            self._connected.add(p.remote_engine_id or "")

    def read(self, p: KVTransferParams, info: side_channel.PeerInfo, local: list[int],
             remote: list[int], token: bytes, grant: bytes) -> XferHandle:
        """READ the holder's `remote` blocks into `local` under its claim `token`."""
        self._connect(p, info)
        return self.transport.read(p.remote_engine_id or "", local, remote,
                                   notif("done", p.remote_request_id or "", token), token, grant)

    def skip(self, p: KVTransferParams, info: side_channel.PeerInfo, token: bytes) -> None:
        """Tell the holder we will not READ its claim (best effort: it expires anyway)."""
        try:
            self._connect(p, info)
            self.transport.send_notif(p.remote_engine_id or "",
                                      notif("skip", p.remote_request_id or "", token))
        except Exception as e:
            log.warning("notify-only to %s failed: %s", p.remote_engine_id, e)

    def poll(self, h: XferHandle) -> XferState:
        return self.transport.poll(h)

    def release(self, h: XferHandle) -> None:
        self.transport.release(h)

    def orphan(self, h: XferHandle | None, blocks: list[int]) -> bool:
        """A READ nobody waits for any more: if it may still land in `blocks`, hold them until
        it ends. -> whether it was still in flight."""
        if h is None or h.state is not XferState.PENDING:
            return False
        self.host.pin(blocks)
        self._orphans.append((h, list(blocks)))
        return True

    def poll_orphans(self) -> None:
        for item in list(self._orphans):
            try:
                if self.transport.poll(item[0]) is not XferState.PENDING:
                    self.transport.release(item[0])
                    self.host.unpin(item[1])
                    self._orphans.remove(item)
            except Exception:
                log.exception("polling an aborted READ failed")

    def num_orphans(self) -> int:
        return len(self._orphans)

    def refs(self) -> dict[int, int]:
        """Block -> references the orphaned READs hold (for integrity checks)."""
        refs: dict[int, int] = {}
        for _, blocks in self._orphans:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        return refs
