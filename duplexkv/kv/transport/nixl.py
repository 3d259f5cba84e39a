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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from duplexkv.kv.transport import cma, meta
from duplexkv.kv.transport.base import (
    DEFAULT_TIMEOUT_S,
    KVTransport,
    Peer,
    PoolLayout,
    XferHandle,
    XferState,
)
from duplexkv.kv.transport.nixl_agent import dlist, make_agent, nixl_errors

log = logging.getLogger(__name__)
UCX_ENV = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_USE_MT_MUTEX", "UCX_CMA_TX_QUOTA",
           "UCX_CMA_SEG_SIZE", "UCX_PROTO_ENABLE")


@dataclass(slots=True)
class _Remote:
    remote_dlist: object  # nixl_prepped_dlist_handle
    data_path: str  # "cma", "tcp (slow, no CMA)", "network (UCX_TLS=...)", "unknown"
    cma_error: str | None


class NixlTransport(KVTransport[_Remote]):
    """`host`: the advertised side-channel address; when it is routable and UCX_NET_DEVICES is
    unset, UCX is restricted to its interface (`_point_ucx_at`; otherwise UCX picks interfaces
    itself, restrict them with UCX_NET_DEVICES, e.g. `lo` in a sandbox). `progress_thread_ms`: poll
    timeout of NIXL's event-driven progress thread, None = no thread (see nixl_agent.py).
    `num_threads`: NIXL's UCX `num_threads` option (0 = its default, one worker). `auth` is
    accepted for symmetry and unused: UCX's one-sided READs are neither authenticated nor
    checked per READ by the holder (docs/protocol.md, section 6: the NIXL limit)."""

    def __init__(self, engine_id: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 host: str | None = None, backends: Sequence[str] = ("UCX",),
                 progress_thread_ms: float | None = 5.0, num_threads: int = 0,
                 auth=None) -> None:
        super().__init__(engine_id, timeout_s)
        self.ucx_device = _point_ucx_at(host)
        self._errors = nixl_errors()
        self.cma_ok, self.cma_reason = cma.ucx_cma_status()
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
        self._reg = None
        self._local_dlist = None
        self._pending: set[XferHandle] = set()
        self._zombies: list[object] = []  # NIXL requests that could not be cancelled yet
        self._backlog: list[tuple[str, bytes]] = []  # notifications seen while settling

    @property
    def name(self) -> str:
        return "nixl"

    def _register_impl(self, pool: torch.Tensor, layout: PoolLayout) -> None:
        self._reg = self.agent.register_memory([(layout.base_ptr, layout.nbytes, 0, "kv")],
                                               "DRAM")
        self._local_dlist = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", dlist(layout.base_ptr, layout.num_blocks, layout.block_bytes),
            "DRAM")

    def _metadata_impl(self, layout: PoolLayout) -> tuple[dict, bytes]:
        return {"base_ptr": layout.base_ptr}, self.agent.get_agent_metadata()

    def _connect_impl(self, peer: str, header: dict, blob: bytes,
                      layout: PoolLayout) -> _Remote:
        if peer == self.engine_id:
            raise ValueError("cannot connect a NIXL agent to itself")
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
        if err is not None:
            self._warn(f"KV reads from {peer} will not use CMA ({err}); UCX falls back to TCP "
                       "(slow). Both workers must run as the same user with ptrace allowed.")
        try:
            self.agent.make_connection(peer)
        except self._errors as e:  # optional optimisation; the first READ connects anyway
            log.debug("make_connection(%s): %s", peer, e)
        return _Remote(remote, path, err)

    def _data_path(self, header: dict) -> tuple[str, str | None]:
        """Which way UCX will move this peer's bytes, checked with the real syscall."""
        if not meta.same_host(header) or not meta.same_net_namespace(header):
            return f"network (UCX_TLS={os.environ.get('UCX_TLS', 'UCX default')})", None
        if not meta.same_pid_namespace(header):
            return "tcp (slow: peer in another PID namespace, no CMA)", "different PID namespace"
        if not self.cma_ok:
            return "tcp (slow: CMA disabled)", self.cma_reason
        err = cma.probe_read(int(header["pid"]), int(header["base_ptr"]))
        if err is not None:
            return "tcp (slow: CMA refused)", err
        return "cma", None

    def _start_read(self, h: XferHandle, conn: _Remote, notif: bytes) -> None:
        try:
            req = self.agent.make_prepped_xfer(
                "READ", self._local_dlist, np.asarray(h.local_block_ids, dtype=np.int32),
                conn.remote_dlist, np.asarray(h.remote_block_ids, dtype=np.int32),
                notif_msg=notif)
            h.impl = req
            status = self.agent.transfer(req)
        except self._errors as e:  # NIXL raises nixlBackendError & co. for a dead peer
            status = f"ERR ({type(e).__name__}: {e})"
        if status == "DONE":
            self._complete(h, XferState.DONE)
        elif status != "PROC":
            self._fail(h, f"NIXL READ from {h.peer!r} could not start: {status}")
        else:
            self._pending.add(h)

    def _fail(self, h: XferHandle, error: str) -> None:
        req, h.impl = h.impl, None
        if req is not None:
            try:
                req.release()  # cancels it if still in flight
            except self._errors as e:
                self._zombies.append(req)
                error += f" (cancelling failed: {e}; local blocks may still be written)"
        self._pending.discard(h)
        self._complete(h, XferState.FAILED, error)
        self._settle()

    def _poll_impl(self, h: XferHandle) -> None:
        try:
            status = self.agent.check_xfer_state(h.impl)
        except self._errors as e:
            status = f"ERR ({type(e).__name__}: {e})"
        if status == "DONE":
            self._pending.discard(h)
            self._complete(h, XferState.DONE)
        elif status != "PROC":
            self._fail(h, f"NIXL READ from {h.peer!r} failed: {status}")
        elif self._threaded:
            os.sched_yield()  # the progress thread completes it: let it have the CPU

    def _poll_overdue(self, h: XferHandle) -> None:
        self._fail(h, f"NIXL READ from {h.peer!r} timed out after {self.timeout_s:g} s")

    def _release_impl(self, h: XferHandle) -> None:
        if h.state is XferState.PENDING:
            self._fail(h, "released while in flight")
        req, h.impl = h.impl, None
        if req is not None:
            try:
                req.release()
            except self._errors:
                self._zombies.append(req)

    def _send_notif_impl(self, peer: str, conn: _Remote, msg: bytes) -> None:
        try:
            self.agent.send_notif(peer, msg)
        except self._errors as e:  # the peer is gone: it has nothing left to free
            self.notif_errors += 1
            log.warning("notification to %s failed: %s: %s", peer, type(e).__name__, e)
            self._settle()

    def _settle(self) -> None:
        """Progress UCX once so endpoints in error get cleaned up (UCX asserts at teardown
        otherwise); keep whatever notifications arrive for the next `get_notifs`."""
        for name, msgs in self.agent.get_new_notifs().items():
            self._backlog += [(str(name), bytes(m)) for m in msgs]

    def _get_notifs_impl(self) -> list[tuple[str, bytes]]:
        if self._closed:
            return []
        if self._zombies:
            self._retry_zombies()
        self._settle()
        out, self._backlog = self._backlog, []
        return out

    def _retry_zombies(self) -> None:
        left = []
        for req in self._zombies:
            try:
                req.release()
            except self._errors:
                left.append(req)
        self._zombies = left

    def _disconnect_impl(self, peer: str, conn: _Remote) -> None:
        for h in [h for h in self._pending if h.peer == peer]:
            self._fail(h, f"disconnected from {peer!r}")
        self._settle()
        try:
            conn.remote_dlist.release()
            self.agent.remove_remote_agent(peer)
        except self._errors as e:
            log.warning("NIXL disconnect from %s: %s", peer, e)

    def _close_impl(self) -> None:
        self._settle()
        self._retry_zombies()
        try:
            if self._local_dlist is not None:
                self._local_dlist.release()
            if self._reg is not None:
                self.agent.deregister_memory(self._reg)
        except self._errors as e:
            log.warning("NIXL close: %s", e)

    def _health_impl(self) -> dict:
        return {
            "backends": list(self.agent.backends), "progress": self.progress,
            "ucx_device": self.ucx_device,
            "ucx_env": self.ucx_env, "ucx_cma": {"enabled": self.cma_ok, "why": self.cma_reason},
            "in_flight": len(self._pending), "uncancelled": len(self._zombies),
            "notif_errors": self.notif_errors,
        }

    def _peer_health(self, p: Peer[_Remote]) -> dict:
        return {"data_path": p.conn.data_path, "cma_error": p.conn.cma_error,
                "same_host": meta.same_host(p.header)}


def _point_ucx_at(host: str | None) -> str | None:
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
