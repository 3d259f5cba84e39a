"""NIXL transport (UCX backend): one-sided READs like vLLM's NixlConnector, on CPU memory.

One agent per worker, named by the engine id (so notifications arrive keyed by the sender's
engine id). By default (`progress_thread_ms=5`) NIXL's progress thread runs event-driven: it
sleeps in poll() and answers the holder side of UCX at once without spinning (see
nixl_agent.py for why either extreme hurts). `progress_thread_ms=None` gives
`enable_prog_thread=False`; then every worker's loop must call `get_notifs` often.
The pool is registered once, as the local side of our READs, and the local descriptor list (one
descriptor per block) is prepared once; a READ is `make_prepped_xfer` by block index +
`transfer` (nixl_reads.py).

Capabilities. A NIXL READ never reaches the holder's code, so the holder cannot check a token per
READ as the TCP transport does. Instead nothing of the pool is published: the metadata that
`connect` takes (handed out by the authenticated side channel) is NIXL's *partial* metadata with
connection info only, so a peer holding it can name no block (NIXL refuses to prepare any remote
descriptor). Each claim registers exactly its blocks while it lives and its grant goes back with
the verify reply (nixl_grants.py). Measured cost: register + partial metadata 5-200 us,
deregister 1-10 us, also for 1 GiB (CMA and TCP; no pages are pinned). What NIXL cannot do:
UCX's CMA and TCP transports do not check, on the holder, that a READ stays inside registered
memory (an rkey is enforced only by an RDMA NIC), so a reader that kept a grant can READ those
addresses after the release, and one that edits the grant can READ any address of the holder's
process (docs/protocol.md, section 6).

Same-host copies need CMA (ptrace permission over the peer); `connect` checks the way each
peer's bytes will go and `health()` / the log say so (nixl_path.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from duplexkv.kv.transport import cma, meta, nixl_path
from duplexkv.kv.transport.base import DEFAULT_TIMEOUT_S, KVTransport
from duplexkv.kv.transport.handle import XferHandle, XferState
from duplexkv.kv.transport.hooks import Peer
from duplexkv.kv.transport.layout import PoolLayout
from duplexkv.kv.transport.nixl_agent import dlist, empty_reg_dlist, make_agent, nixl_errors
from duplexkv.kv.transport.nixl_grants import NixlGrants
from duplexkv.kv.transport.nixl_path import NixlPeer
from duplexkv.kv.transport.nixl_reads import NixlReads

log = logging.getLogger(__name__)


class NixlTransport(KVTransport[NixlPeer]):
    """`host`: the advertised side-channel address; when it is routable and UCX_NET_DEVICES is
    unset, UCX is restricted to its interface (`nixl_path.point_ucx_at`; otherwise UCX picks
    interfaces itself, restrict them with UCX_NET_DEVICES, e.g. `lo` in a sandbox).
    `progress_thread_ms`: poll timeout of NIXL's event-driven progress thread, None = no thread
    (see nixl_agent.py). `num_threads`: NIXL's UCX `num_threads` option (0 = its default, one
    worker). `auth` is accepted for symmetry and unused: UCX's one-sided READs are neither
    authenticated nor checked per READ by the holder: claims decide what is registered
    (`expose`)."""

    def __init__(self, engine_id: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 host: str | None = None, backends: Sequence[str] = ("UCX",),
                 progress_thread_ms: float | None = 5.0, num_threads: int = 0,
                 auth=None) -> None:
        super().__init__(engine_id, timeout_s)
        self.ucx_device = nixl_path.point_ucx_at(host)
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
        self.ucx_env = nixl_path.ucx_env()
        if not self.agent.backends:
            raise RuntimeError(f"NIXL could not create any of the backends {list(backends)}; "
                               f"available plugins: {self.agent.get_plugin_list()}")
        self._reg = None
        self._local_dlist = None
        self._reads = NixlReads(self.agent, self._errors)
        self._backlog: list[tuple[str, bytes]] = []  # notifications seen while settling
        self._grants = NixlGrants(self.agent, self._errors)

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
        # connection info only: no registered region, so no block can be named with it
        blob = self.agent.get_partial_agent_metadata(empty_reg_dlist(), True, ["UCX"])
        return {"base_ptr": layout.base_ptr}, blob

    def expose(self, token: bytes, block_ids: tuple[int, ...]) -> bytes:
        return self._grants.expose(self._need_registered(), token, block_ids)

    def withdraw(self, token: bytes) -> None:
        self._grants.withdraw(token)

    def _connect_impl(self, peer: str, header: dict, blob: bytes,
                      layout: PoolLayout) -> NixlPeer:
        if peer == self.engine_id:
            raise ValueError("cannot connect a NIXL agent to itself")
        name = self.agent.add_remote_agent(blob)
        if isinstance(name, bytes):
            name = name.decode()
        if name != peer:
            self.agent.remove_remote_agent(name)
            raise ValueError(f"NIXL agent in the metadata is {name!r}, expected {peer!r}")
        path, err = nixl_path.data_path(header, self.cma_ok, self.cma_reason)
        if err is not None:
            self._warn(f"KV reads from {peer} will not use CMA ({err}); UCX falls back to TCP "
                       "(slow). Both workers must run as the same user with ptrace allowed.")
        try:
            self.agent.make_connection(peer)
        except self._errors as e:  # optional optimisation; the first READ connects anyway
            log.debug("make_connection(%s): %s", peer, e)
        return NixlPeer(int(header["base_ptr"]), path, err)

    def _start_read(self, h: XferHandle, conn: NixlPeer, notif: bytes) -> None:
        if not h.grant:
            self._complete(h, XferState.FAILED, f"no NIXL grant from {h.peer!r} for this READ "
                           "(the holder exposes blocks only to a claim's verify)")
            return
        layout = self._need_registered()
        status = self._reads.start(h, conn, self._local_dlist, layout.block_bytes, notif)
        if status == "DONE":
            self._complete(h, XferState.DONE)
        elif status != "PROC":
            self._fail(h, f"NIXL READ from {h.peer!r} could not start: {status}")
        else:
            self._reads.pending.add(h)

    def _fail(self, h: XferHandle, error: str) -> None:
        rd, h.impl = h.impl, None
        if rd is not None and not self._reads.release(rd):
            error += " (cancelling failed; local blocks may still be written)"
        self._reads.pending.discard(h)
        self._complete(h, XferState.FAILED, error)
        self._settle()

    def _poll_impl(self, h: XferHandle) -> None:
        status = self._reads.check(h)
        if status == "DONE":
            self._reads.pending.discard(h)
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
        rd, h.impl = h.impl, None
        if rd is not None:
            self._reads.release(rd)

    def _send_notif_impl(self, peer: str, conn: NixlPeer, msg: bytes) -> None:
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
        if self._reads.zombies:
            self._reads.retry_zombies()
        self._settle()
        out, self._backlog = self._backlog, []
        return out

    def _disconnect_impl(self, peer: str, conn: NixlPeer) -> None:
        for h in [h for h in self._reads.pending if h.peer == peer]:
            self._fail(h, f"disconnected from {peer!r}")
        self._settle()
        try:
            self.agent.remove_remote_agent(peer)
        except self._errors as e:
            log.warning("NIXL disconnect from %s: %s", peer, e)

    def _close_impl(self) -> None:
        self._settle()
        self._reads.retry_zombies()
        try:
            self._grants.close()
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
            "in_flight": len(self._reads.pending), "uncancelled": len(self._reads.zombies),
            "notif_errors": self.notif_errors, **self._grants.health(),
        }

    def _peer_health(self, p: Peer[NixlPeer]) -> dict:
        return {"data_path": p.conn.data_path, "cma_error": p.conn.cma_error,
                "same_host": meta.same_host(p.header), "grants_loaded": p.conn.grants_loaded}
