"""NIXL transport (UCX backend): one-sided READs like vLLM's NixlConnector, on CPU memory.

Longer than 300 lines: NIXL's request lifecycle (start, poll, cancel, zombies, notifications)
and the per-claim exposure of blocks are one state machine around one agent.

One agent per worker, named by the engine id (so notifications arrive keyed by the sender's
engine id). By default (`progress_thread_ms=5`) NIXL's progress thread runs event-driven: it
sleeps in poll() and answers the holder side of UCX at once without spinning (see
nixl_agent.py for why either extreme hurts). `progress_thread_ms=None` gives
`enable_prog_thread=False`; then every worker's loop must call `get_notifs` often.
The pool is registered once, as the local side of our READs, and the local descriptor list (one
descriptor per block) is prepared once; a READ is `make_prepped_xfer` by block index +
`transfer`.

Capabilities. A NIXL READ never reaches the holder's code, so the holder cannot check a token per
READ as the TCP transport does. Instead nothing of the pool is published: the metadata that
`connect` takes (handed out by the authenticated side channel) is NIXL's *partial* metadata with
connection info only, so a peer holding it can name no block (NIXL refuses to prepare any remote
descriptor). When a claim is made the holder registers exactly the claim's blocks (`expose`, one
region per run of consecutive blocks) and returns their partial metadata, the grant, with the
verify reply; the reader loads it and prepares descriptors for just the blocks it READs. When the
claim ends (done, skip, release, expiry, lapse) the holder deregisters it (`withdraw`). Measured
cost: register + partial metadata 5-200 us, deregister 1-10 us, also for 1 GiB (CMA and TCP;
no pages are pinned). What NIXL cannot do: UCX's CMA and TCP transports do not check, on the
holder, that a READ stays inside registered memory (an rkey is enforced only by an RDMA NIC), so
a reader that kept a grant can READ those addresses after the release, and one that edits the
grant can READ any address of the holder's process (docs/protocol.md, section 6).

Same-host copies go through UCX's `cma` transport (process_vm_readv, the
copy runs on the reader's thread inside `read`/`poll`), which needs ptrace permission over the
peer; without it UCX silently moves the data over TCP. `connect` checks that with the very same
syscall against the peer's pool and `health()` / the log say so (see cma.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
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
    runs,
)
from duplexkv.kv.transport.nixl_agent import (
    block_dlist,
    dlist,
    empty_reg_dlist,
    make_agent,
    nixl_errors,
)

log = logging.getLogger(__name__)
UCX_ENV = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_USE_MT_MUTEX", "UCX_CMA_TX_QUOTA",
           "UCX_CMA_SEG_SIZE", "UCX_PROTO_ENABLE")


@dataclass(slots=True)
class _Remote:
    base_ptr: int  # the peer's pool address (block b is at base_ptr + b * block_bytes)
    data_path: str  # "cma", "tcp (slow, no CMA)", "network (UCX_TLS=...)", "unknown"
    cma_error: str | None
    grants_loaded: int = 0


@dataclass(slots=True)
class _Read:
    req: object | None  # nixl_xfer_handle
    remote: object  # the READ's own prepared remote descriptors (its grant's blocks)


class NixlTransport(KVTransport[_Remote]):
    """`host`: the advertised side-channel address; when it is routable and UCX_NET_DEVICES is
    unset, UCX is restricted to its interface (`_point_ucx_at`; otherwise UCX picks interfaces
    itself, restrict them with UCX_NET_DEVICES, e.g. `lo` in a sandbox). `progress_thread_ms`: poll
    timeout of NIXL's event-driven progress thread, None = no thread (see nixl_agent.py).
    `num_threads`: NIXL's UCX `num_threads` option (0 = its default, one worker). `auth` is
    accepted for symmetry and unused: UCX's one-sided READs are neither authenticated nor
    checked per READ by the holder: claims decide what is registered (`expose`)."""

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
        self._zombies: list[_Read] = []  # READs whose NIXL request could not be cancelled yet
        self._backlog: list[tuple[str, bytes]] = []  # notifications seen while settling
        self._grants: dict[bytes, object] = {}  # claim token -> its nixlRegDList
        self._grants_lock = threading.Lock()
        self.grants_issued = 0
        self.grant_seconds = 0.0  # time spent registering claims and deregistering them

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
        layout = self._need_registered()
        if not block_ids:
            return b""
        regions = [(layout.base_ptr + b * layout.block_bytes, n * layout.block_bytes, 0, "")
                   for b, n in runs(block_ids)]
        t0 = time.perf_counter()
        with self._grants_lock:
            reg = self.agent.register_memory(regions, "DRAM", ["UCX"])
            try:
                grant = self.agent.get_partial_agent_metadata(reg, False, ["UCX"])
            except self._errors:
                self.agent.deregister_memory(reg, ["UCX"])
                raise
            old = self._grants.pop(bytes(token), None)
            self._grants[bytes(token)] = reg
            self.grants_issued += 1
            if old is not None:
                self.agent.deregister_memory(old, ["UCX"])
            self.grant_seconds += time.perf_counter() - t0
        return bytes(grant)

    def withdraw(self, token: bytes) -> None:
        with self._grants_lock:
            reg = self._grants.pop(bytes(token), None)
            if reg is not None and not self._closed:
                t0 = time.perf_counter()
                try:
                    self.agent.deregister_memory(reg, ["UCX"])
                except self._errors as e:
                    log.warning("NIXL: deregistering a claim's blocks failed: %s", e)
                self.grant_seconds += time.perf_counter() - t0

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
        path, err = self._data_path(header)
        if err is not None:
            self._warn(f"KV reads from {peer} will not use CMA ({err}); UCX falls back to TCP "
                       "(slow). Both workers must run as the same user with ptrace allowed.")
        try:
            self.agent.make_connection(peer)
        except self._errors as e:  # optional optimisation; the first READ connects anyway
            log.debug("make_connection(%s): %s", peer, e)
        return _Remote(int(header["base_ptr"]), path, err)

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
        if not h.grant:
            self._complete(h, XferState.FAILED, f"no NIXL grant from {h.peer!r} for this READ "
                           "(the holder exposes blocks only to a claim's verify)")
            return
        try:
            name = self.agent.add_remote_agent(h.grant)  # adds just the claim's regions
            if (name.decode() if isinstance(name, bytes) else name) != h.peer:
                raise ValueError(f"the grant is for NIXL agent {name!r}, not {h.peer!r}")
            conn.grants_loaded += 1
            n = len(h.remote_block_ids)
            remote = self.agent.prep_xfer_dlist(  # refused unless the grant covers them all
                h.peer, block_dlist(conn.base_ptr, h.remote_block_ids, self.layout.block_bytes),
                "DRAM")
            h.impl = _Read(None, remote)
            h.impl.req = self.agent.make_prepped_xfer(
                "READ", self._local_dlist, np.asarray(h.local_block_ids, dtype=np.int32),
                remote, np.arange(n, dtype=np.int32), notif_msg=notif)
            status = self.agent.transfer(h.impl.req)
        except self._errors as e:  # NIXL raises nixlBackendError & co. for a dead peer
            status = f"ERR ({type(e).__name__}: {e})"
        if status == "DONE":
            self._complete(h, XferState.DONE)
        elif status != "PROC":
            self._fail(h, f"NIXL READ from {h.peer!r} could not start: {status}")
        else:
            self._pending.add(h)

    def _fail(self, h: XferHandle, error: str) -> None:
        rd, h.impl = h.impl, None
        if rd is not None and not self._release_read(rd):
            error += " (cancelling failed; local blocks may still be written)"
        self._pending.discard(h)
        self._complete(h, XferState.FAILED, error)
        self._settle()

    def _poll_impl(self, h: XferHandle) -> None:
        try:
            status = self.agent.check_xfer_state(h.impl.req)
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
        rd, h.impl = h.impl, None
        if rd is not None:
            self._release_read(rd)

    def _release_read(self, rd: _Read) -> bool:
        """Release (cancelling it if in flight) a READ's request, then its remote descriptors;
        False, and kept for a later retry, if NIXL could not release the request yet."""
        if rd.req is not None:
            try:
                rd.req.release()
            except self._errors as e:
                log.debug("NIXL: releasing a READ failed (will retry): %s", e)
                self._zombies.append(rd)
                return False
            rd.req = None
        if rd.remote is not None:
            try:
                rd.remote.release()
            except self._errors as e:
                log.debug("NIXL: releasing a READ's remote descriptors: %s", e)
            rd.remote = None
        return True

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
        zombies, self._zombies = self._zombies, []
        for rd in zombies:
            self._release_read(rd)  # puts it back if it still cannot be released

    def _disconnect_impl(self, peer: str, conn: _Remote) -> None:
        for h in [h for h in self._pending if h.peer == peer]:
            self._fail(h, f"disconnected from {peer!r}")
        self._settle()
        try:
            self.agent.remove_remote_agent(peer)
        except self._errors as e:
            log.warning("NIXL disconnect from %s: %s", peer, e)

    def _close_impl(self) -> None:
        self._settle()
        self._retry_zombies()
        with self._grants_lock:
            grants, self._grants = list(self._grants.values()), {}
        try:
            for reg in grants:
                self.agent.deregister_memory(reg, ["UCX"])
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
            "notif_errors": self.notif_errors, "exposed_claims": len(self._grants),
            "grants_issued": self.grants_issued,
            "grant_ms_per_claim": round(self.grant_seconds * 1e3 / max(1, self.grants_issued), 4),
        }

    def _peer_health(self, p: Peer[_Remote]) -> dict:
        return {"data_path": p.conn.data_path, "cma_error": p.conn.cma_error,
                "same_host": meta.same_host(p.header), "grants_loaded": p.conn.grants_loaded}



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
