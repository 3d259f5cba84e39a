"""NIXL transport (UCX backend): one-sided READs like vLLM's NixlConnector, on CPU memory.

One agent per worker, named by the engine id (so notifications arrive keyed by the sender's
engine id). By default (`progress_thread_ms=5`) NIXL's progress thread runs event-driven: it
sleeps in poll() and answers the holder side of UCX at once without spinning (see
nixl_agent.py for why either extreme hurts). `progress_thread_ms=None` gives
`enable_prog_thread=False`; then every worker's loop must call `get_notifs` often.
The pool is registered once, the local descriptor list (one descriptor per block) is prepared
once, and each peer's remote list once per `connect`; a READ is `make_prepped_xfer` by block
index + `transfer`. Same-host copies go through UCX's `cma` transport (process_vm_readv, the
copy runs on the reader's thread inside `read`/`poll`), which needs ptrace permission over the
peer; without it UCX silently moves the data over TCP. `connect` checks that with the very same
syscall against the peer's pool and `health()` / the log say so (see cma.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from duplexkv.kv.transport import cma, meta
from duplexkv.kv.transport.base import (
    DEFAULT_TIMEOUT_S,
    KVTransport,
    PoolLayout,
    TransferStats,
    XferHandle,
    XferState,
    check_block_ids,
)
from duplexkv.kv.transport.nixl_agent import dlist, make_agent, nixl_errors

log = logging.getLogger(__name__)
UCX_ENV = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_USE_MT_MUTEX", "UCX_CMA_TX_QUOTA",
           "UCX_CMA_SEG_SIZE", "UCX_PROTO_ENABLE")


@dataclass(slots=True)
class _Peer:
    metadata: bytes
    header: dict
    remote_dlist: object  # nixl_prepped_dlist_handle
    data_path: str  # "cma", "tcp (slow, no CMA)", "network", "unknown"
    cma_error: str | None


class NixlTransport(KVTransport):
    """`host` is accepted for interface symmetry and unused: UCX picks interfaces itself
    (restrict them with UCX_NET_DEVICES, e.g. `lo` in a sandbox). `progress_thread_ms`: poll
    timeout of NIXL's event-driven progress thread, None = no thread (see nixl_agent.py).
    `num_threads`: NIXL's UCX `num_threads` option (0 = its default, one worker)."""

    def __init__(self, engine_id: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 host: str | None = None, backends: Sequence[str] = ("UCX",),
                 progress_thread_ms: float | None = 5.0, num_threads: int = 0) -> None:
        self.engine_id = engine_id
        self.timeout_s = float(timeout_s)
        self.stats = TransferStats()
        self._errors = nixl_errors()
        self.cma_ok, self.cma_reason = cma.ucx_cma_status()
        self.warnings: list[str] = []
        self.notif_errors = 0
        if not self.cma_ok:
            self._warn(f"UCX cannot use CMA ({self.cma_reason}): same-host KV reads will go over "
                       "TCP, several times slower. Allow ptrace between the workers (same user, "
                       "Yama ptrace_scope 0 or 1, or CAP_SYS_PTRACE) or use the tcp transport.")
        self.agent, self.progress, warning = make_agent(engine_id, list(backends),
                                                        progress_thread_ms, self._errors,
                                                        num_threads)
        if warning:
            self._warn(warning)
        self._threaded = self.progress.startswith("event-driven")
        self.ucx_env = {k: os.environ[k] for k in UCX_ENV if k in os.environ}
        if not self.agent.backends:
            raise RuntimeError(f"NIXL could not create any of the backends {list(backends)}; "
                               f"available plugins: {self.agent.get_plugin_list()}")
        self.layout: PoolLayout | None = None
        self._pool: torch.Tensor | None = None
        self._reg = None
        self._local_dlist = None
        self._peers: dict[str, _Peer] = {}
        self._pending: set[XferHandle] = set()
        self._zombies: list[object] = []  # NIXL requests that could not be cancelled yet
        self._backlog: list[tuple[str, bytes]] = []  # notifications seen while settling
        self._closed = False

    def _warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)
            log.warning("%s", msg)

    @property
    def name(self) -> str:
        return "nixl"

    def register(self, pool: torch.Tensor) -> None:
        if self.layout is not None:
            raise RuntimeError("register() may be called only once")
        layout = PoolLayout.of(pool)
        self._reg = self.agent.register_memory([(layout.base_ptr, layout.nbytes, 0, "kv")],
                                               "DRAM")
        self._local_dlist = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", dlist(layout.base_ptr, layout.num_blocks, layout.block_bytes),
            "DRAM")
        self.layout, self._pool = layout, pool

    def _need_registered(self) -> PoolLayout:
        if self.layout is None or self._closed:
            raise RuntimeError("the transport is closed or has no registered pool")
        return self.layout

    def metadata(self) -> bytes:
        layout = self._need_registered()
        return meta.pack({"kind": "nixl", "engine_id": self.engine_id,
                          "num_blocks": layout.num_blocks, "block_bytes": layout.block_bytes,
                          "base_ptr": layout.base_ptr, **meta.host_identity()},
                         self.agent.get_agent_metadata())

    def connect(self, peer: str, peer_metadata: bytes) -> None:
        layout = self._need_registered()
        old = self._peers.get(peer)
        if old is not None and old.metadata == bytes(peer_metadata):
            return
        header, blob = meta.unpack(peer_metadata)
        meta.check_peer(header, "nixl", peer, layout.block_bytes)
        if peer == self.engine_id:
            raise ValueError("cannot connect a NIXL agent to itself")
        self.disconnect(peer)
        name = self.agent.add_remote_agent(blob)
        if isinstance(name, bytes):
            name = name.decode()
        if name != peer:
            self.agent.remove_remote_agent(name)
            raise ValueError(f"NIXL agent in the metadata is {name!r}, expected {peer!r}")
        try:
            remote = self.agent.prep_xfer_dlist(
                peer, dlist(int(header["base_ptr"]), int(header["num_blocks"]),
                             layout.block_bytes), "DRAM")
        except self._errors:
            self.agent.remove_remote_agent(peer)
            raise
        path, err = self._data_path(header)
        self._peers[peer] = _Peer(bytes(peer_metadata), header, remote, path, err)
        if err is not None:
            self._warn(f"KV reads from {peer} will not use CMA ({err}); UCX falls back to TCP "
                       "(slow). Both workers must run as the same user with ptrace allowed.")
        try:
            self.agent.make_connection(peer)
        except self._errors as e:  # optional optimisation; the first READ connects anyway
            log.debug("make_connection(%s): %s", peer, e)

    def _data_path(self, header: dict) -> tuple[str, str | None]:
        """Which way UCX will move this peer's bytes, checked with the real syscall."""
        if not meta.same_host(header):
            return "network", None
        if not meta.same_pid_namespace(header):
            return "tcp (slow: peer in another PID namespace, no CMA)", "different PID namespace"
        if not self.cma_ok:
            return "tcp (slow: CMA disabled)", self.cma_reason
        err = cma.probe_read(int(header["pid"]), int(header["base_ptr"]))
        if err is not None:
            return "tcp (slow: CMA refused)", err
        return "cma", None

    def _peer(self, peer: str) -> _Peer:
        self._need_registered()
        p = self._peers.get(peer)
        if p is None:
            raise RuntimeError(f"not connected to peer {peer!r}; call connect() first")
        return p

    def read(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
             notif: bytes) -> XferHandle:
        layout = self._need_registered()
        p = self._peer(peer)
        loc, rem = check_block_ids(local_block_ids, remote_block_ids, layout.num_blocks,
                                   int(p.header["num_blocks"]))
        now = time.monotonic()
        h = XferHandle(peer, loc, rem, len(loc) * layout.block_bytes, now + self.timeout_s, now)
        self.stats.reads += 1
        if not loc:
            self.send_notif(peer, notif)
            h._finish(XferState.DONE)
            self.stats.finished(h)
            return h
        try:
            req = self.agent.make_prepped_xfer(
                "READ", self._local_dlist, np.asarray(loc, dtype=np.int32), p.remote_dlist,
                np.asarray(rem, dtype=np.int32), notif_msg=bytes(notif))
            h.impl = req
            status = self.agent.transfer(req)
        except self._errors as e:  # NIXL raises nixlBackendError & co. for a dead peer
            status = f"ERR ({type(e).__name__}: {e})"
        if status == "DONE":
            h._finish(XferState.DONE)
            self.stats.finished(h)
        elif status != "PROC":
            self._fail(h, f"NIXL READ from {peer!r} could not start: {status}")
        else:
            self._pending.add(h)
        return h

    def _fail(self, h: XferHandle, error: str) -> None:
        req, h.impl = h.impl, None
        if req is not None:
            try:
                req.release()  # cancels it if still in flight
            except self._errors as e:
                self._zombies.append(req)
                error += f" (cancelling failed: {e}; local blocks may still be written)"
        h._finish(XferState.FAILED, error)
        self._pending.discard(h)
        self.stats.finished(h)
        self._settle()

    def poll(self, handle: XferHandle) -> XferState:
        if handle.state is not XferState.PENDING:
            return handle.state
        try:
            status = self.agent.check_xfer_state(handle.impl)
        except self._errors as e:
            status = f"ERR ({type(e).__name__}: {e})"
        if status == "DONE":
            handle._finish(XferState.DONE)
            self._pending.discard(handle)
            self.stats.finished(handle)
        elif status != "PROC":
            self._fail(handle, f"NIXL READ from {handle.peer!r} failed: {status}")
        elif time.monotonic() > handle.deadline:
            self._fail(handle, f"NIXL READ from {handle.peer!r} timed out after "
                               f"{self.timeout_s:g} s")
        elif self._threaded:
            os.sched_yield()  # the progress thread completes it: let it have the CPU
        return handle.state

    def release(self, handle: XferHandle) -> None:
        if handle.state is XferState.PENDING:
            self._fail(handle, "released while in flight")
        req, handle.impl = handle.impl, None
        if req is not None:
            try:
                req.release()
            except self._errors:
                self._zombies.append(req)

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._peer(peer)
        self.stats.notifs_sent += 1
        try:
            self.agent.send_notif(peer, bytes(msg))
        except self._errors as e:  # the peer is gone: it has nothing left to free
            self.notif_errors += 1
            log.warning("notification to %s failed: %s: %s", peer, type(e).__name__, e)
            self._settle()

    def _settle(self) -> None:
        """Progress UCX once so endpoints in error get cleaned up (UCX asserts at teardown
        otherwise); keep whatever notifications arrive for the next `get_notifs`."""
        for name, msgs in self.agent.get_new_notifs().items():
            self._backlog += [(str(name), bytes(m)) for m in msgs]

    def get_notifs(self) -> list[tuple[str, bytes]]:
        if self._closed:
            return []
        if self._zombies:
            self._retry_zombies()
        self._settle()
        out, self._backlog = self._backlog, []
        self.stats.notifs_received += len(out)
        return out

    def _retry_zombies(self) -> None:
        left = []
        for req in self._zombies:
            try:
                req.release()
            except self._errors:
                left.append(req)
        self._zombies = left

    def disconnect(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        if p is None:
            return
        for h in [h for h in self._pending if h.peer == peer]:
            self._fail(h, f"disconnected from {peer!r}")
        self._settle()
        try:
            p.remote_dlist.release()
            self.agent.remove_remote_agent(peer)
        except self._errors as e:
            log.warning("NIXL disconnect from %s: %s", peer, e)

    def close(self) -> None:
        if self._closed:
            return
        for peer in list(self._peers):
            self.disconnect(peer)
        self._settle()
        self._retry_zombies()
        try:
            if self._local_dlist is not None:
                self._local_dlist.release()
            if self._reg is not None:
                self.agent.deregister_memory(self._reg)
        except self._errors as e:
            log.warning("NIXL close: %s", e)
        self._closed = True

    def health(self) -> dict:
        return {
            "transport": "nixl", "engine_id": self.engine_id, "closed": self._closed,
            "backends": list(self.agent.backends), "progress": self.progress,
            "timeout_s": self.timeout_s,
            "ucx_env": self.ucx_env, "ucx_cma": {"enabled": self.cma_ok, "why": self.cma_reason},
            "peers": {name: {"data_path": p.data_path, "cma_error": p.cma_error,
                             "same_host": meta.same_host(p.header)}
                      for name, p in self._peers.items()},
            "in_flight": len(self._pending), "uncancelled": len(self._zombies),
            "notif_errors": self.notif_errors,
            **self.stats.as_dict(), "warnings": list(self.warnings),
        }
