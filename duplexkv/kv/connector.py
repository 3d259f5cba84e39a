"""The KV connector: the engine's `KVConnectorBase`, composed of a holder and a reader.

    engine calls            connector                     parts
    wants_remote_kv         remember the params; pull?    Holder.kind_for, threshold_for
                            (decode_local: own history)   LocalReuse.adopt
    start_pull              verify, then READ             Reader.start
    poll                    events; notifications;        Reader.poll, Holder.on_notification,
                            expiries                      Holder.expire
    on_finish               keep blocks, return params    Holder.hold
    on_abort                forget                        Reader.forget
    reclaim / extra_refs    release / count held blocks   Holder.reclaim / Holder + Reader refs

It owns the shared pieces: the side channel (served by the holder), the transport (READs by the
reader, served for the holder), and the per-peer gate and thread pool for network jobs. See
docs/architecture.md for the sequence of a pull.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq

from duplexkv.engine.kv_transfer import ConnectorEvent, EngineHost, KVConnectorBase
from duplexkv.engine.sequence import Sequence
from duplexkv.http import retention_sync as rs
from duplexkv.kv import addresses
from duplexkv.kv import auth as kvauth
from duplexkv.kv import side_channel
from duplexkv.kv.addresses import Listen
from duplexkv.kv.config import KVConfigError, KVTransferConfig
from duplexkv.kv.holder import Holder
from duplexkv.kv.local_reuse import LocalReuse, is_decode_local
from duplexkv.kv.peer_gate import PeerGate
from duplexkv.kv.pull_decision import threshold_for
from duplexkv.kv.reader import Reader
from duplexkv.kv.transport import make_transport
from duplexkv.wire.kv_params import KVTransferParams

log = logging.getLogger(__name__)
PROTOCOL_VERSION = "duplexkv-kv-2"  # 2: capability tokens, authenticated HELLO
NET_THREADS = 8


class KVConnector(KVConnectorBase):
    def __init__(self, cfg: KVTransferConfig, host: EngineHost) -> None:
        self.cfg = cfg
        self.host = host
        layout = host.kv_layout()
        auth = kvauth.load(cfg.auth_secret_file, cfg.insecure_kv)  # never logged, never in a repr
        listens = [Listen("side channel", cfg.side_channel_bind, cfg.side_channel_host,
                          cfg.side_channel_port)]
        if cfg.transport == "tcp":
            listens.append(Listen("transport", cfg.transfer_bind, cfg.transfer_host,
                                  cfg.transfer_port))
        for listen in listens:
            kvauth.check_bind(auth, listen.what.replace(" ", "_") + "_host", listen.bind_host)
            addresses.check(listen)
        self.auth = auth
        self.engine_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.compat_hash = hashlib.sha256(
            layout.fingerprint
            + f"{PROTOCOL_VERSION}/{tuple(host.kv_pool().shape[1:])}".encode()).hexdigest()
        self.transport = make_transport(cfg.transport, engine_id=self.engine_id,
                                        timeout_s=cfg.read_timeout_s, auth=auth,
                                        **self._transport_options(cfg))
        self.transport.register(host.kv_pool())
        self.pool = ThreadPoolExecutor(NET_THREADS, thread_name_prefix="kv-net")
        self.gate = PeerGate(self.pool, cfg.peer_max_in_flight, cfg.peer_breaker_s)
        self.holder = Holder(cfg, host, layout.block_size, layout.fingerprint, self.engine_id,
                             auth, grants=self.transport)  # NIXL: registers each claim's blocks
        self.transport.read_authorizer = self.holder.authorize_read  # TCP: checks each READ
        self.reader = Reader(cfg, host, self.transport, self.gate, self.compat_hash, auth)
        hs = side_channel.Handshake(self.engine_id, self.compat_hash, cfg.transport,
                                    self.transport.metadata(), layout.block_size,
                                    layout.num_blocks, layout.block_bytes)
        try:
            self.server = side_channel.SideChannelServer(
                cfg.side_channel_bind, cfg.side_channel_port, hs,
                {"verify": self.holder.serve_verify, "hb": self.holder.serve_heartbeat}, auth)
        except zmq.ZMQError as e:
            self.transport.close()
            raise KVConfigError(f"the KV side channel cannot listen on {cfg.side_channel_bind}:"
                                f"{cfg.side_channel_port}: {e} (VLLM_NIXL_SIDE_CHANNEL_PORT / "
                                "side_channel_port: pick a free port, or 0)") from None
        self.holder.address = (cfg.side_channel_host, self.server.port)
        self.local = LocalReuse(self.holder, host, layout, self.engine_id, auth)
        self.holding: dict[str, str] = {}  # request id -> what finishing it leaves held
        self.to_pull: dict[str, tuple[KVTransferParams, int]] = {}  # until start_pull
        self.server.start()

    @staticmethod
    def _transport_options(cfg: KVTransferConfig) -> dict:
        if cfg.transport == "tcp":
            return {"host": cfg.transfer_bind, "port": cfg.transfer_port,
                    "advertise_host": cfg.transfer_host, "stall_s": cfg.read_stall_s}
        # NIXL: UCX listens on the interface that carries the advertised side-channel address
        return {"host": cfg.side_channel_host}

    @property
    def retained(self):
        return self.holder.retained

    # KVConnectorBase ---------------------------------------------------------------------
    def wants_remote_kv(self, seq: Sequence, params: KVTransferParams) -> bool:
        if is_decode_local(params):  # the next turn on the D that holds the history
            self.local.adopt(seq, params)
            if self.cfg.bidirectional_kv_xfer:
                self.holding[seq.request_id] = "ttl"
            return False
        kind = self.holder.kind_for(params)
        if kind is not None:
            self.holding[seq.request_id] = kind
        threshold = threshold_for(self.cfg, params)
        if threshold is None:
            return False
        self.to_pull[seq.request_id] = (params, threshold)
        return True

    def start_pull(self, seq: Sequence) -> None:
        params, threshold = self.to_pull.pop(seq.request_id)
        self.reader.start(seq, params, threshold)

    def poll(self) -> list[ConnectorEvent]:
        events = self.reader.poll()
        for _, msg in self.transport.get_notifs():
            self.holder.on_notification(msg)
        self.holder.expire()
        return events

    def poll_timeout(self) -> float | None:
        if self.reader.busy():
            return 0.001
        return 0.05 if len(self.holder.retained) else None

    def on_finish(self, seq: Sequence, reason: str) -> KVTransferParams | None:
        kind = self.holding.pop(seq.request_id, None)
        if kind is None or reason not in ("stop", "length"):
            return None
        return self.holder.hold(seq, kind)

    def on_abort(self, seq: Sequence) -> None:
        self.holding.pop(seq.request_id, None)
        self.to_pull.pop(seq.request_id, None)
        self.reader.forget(seq)

    def reclaim(self, need_blocks: int) -> int:
        return self.holder.reclaim(need_blocks)

    def extra_refs(self) -> dict[int, int]:
        refs = self.holder.refs()
        for b, n in self.reader.refs().items():
            refs[b] = refs.get(b, 0) + n
        return refs

    # the router's retention sync (served by the worker at POST /v1/kv/retention) ----------
    def sync_retention(self, req: rs.SyncRequest) -> tuple[rs.SyncReply, bool]:
        """Renewals and deletions from the router; thread-safe (the retention table's lock), so
        the HTTP thread calls it. -> (the reply, whether entries were marked deleted: call
        `release_deleted` on the engine thread to free their blocks now)."""
        return self.holder.sync(req)

    def release_deleted(self) -> None:
        """Free what deletions and expiry released (engine thread)."""
        self.holder.expire()

    # reporting / lifecycle ---------------------------------------------------------------
    def structures(self) -> dict:
        """Sizes of the connector's per-request maps, for /debug/memory."""
        r = self.reader
        return {"kv.pulls": len(r.pulls), "kv.holding": len(self.holding),
                "kv.to_pull": len(self.to_pull), "kv.peers": r.client.num_peers(),
                "kv.orphans": r.transfers.num_orphans(), "kv.retained": len(self.holder.retained)}

    def health(self) -> dict:
        counters = {**self.reader.counters.as_dict(), "retained": dict(self.holder.counters)}
        return {"engine_id": self.engine_id, "kv_connector": self.cfg.kv_connector,
                "kv_auth": "cluster secret" if self.auth.enabled else "loopback only",
                "side_channel": f"{self.cfg.side_channel_host}:{self.server.port}",
                "side_channel_bind": f"{self.server.host}:{self.server.port}",
                "transport": self.transport.health(), "retained": self.holder.retained.stats(),
                "pulls_in_flight": len(self.reader.pulls), "counters": counters,
                "side_channel_sockets": self.reader.client.sockets(),
                "decode_local": self.local.state(),
                "cost_model": self.host.prefill_cost_model().as_dict(), "links": self.reader.link.state(),
                "peers": self.gate.state()}

    def close(self) -> None:
        self.server.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.reader.close()
        self.transport.close()
