"""The reader's NIXL READs: starting one from its grant, checking it, and releasing what it
holds, including the requests NIXL would not release yet.

A READ loads the holder's grant (the claim's regions only), prepares remote descriptors for just
the blocks it READs (NIXL refuses any block outside the grant) and makes one prepped transfer
from the local descriptor list (one descriptor per block, prepared once at registration). NIXL
may refuse to release a request that is still in flight; such a READ is kept and its release
retried later (`zombies`), since until then its local blocks may still be written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from duplexkv.kv.transport.handle import XferHandle
from duplexkv.kv.transport.nixl_agent import block_dlist
from duplexkv.kv.transport.nixl_path import NixlPeer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NixlRead:
    req: object | None  # nixl_xfer_handle
    remote: object  # the READ's own prepared remote descriptors (its grant's blocks)


class NixlReads:
    def __init__(self, agent, errors: tuple[type[BaseException], ...]) -> None:
        self.agent, self.errors = agent, errors
        self.pending: set[XferHandle] = set()  # started, not yet DONE or FAILED
        self.zombies: list[NixlRead] = []  # READs whose NIXL request could not be released yet

    def start(self, h: XferHandle, peer: NixlPeer, local_dlist, block_bytes: int,
              notif: bytes) -> str:
        """Start `h` (it carries a grant); -> NIXL's status: "DONE", "PROC" or why not. The
        request is `h.impl` (a NixlRead) as soon as it exists."""
        try:
            name = self.agent.add_remote_agent(h.grant)  # adds just the claim's regions
            if (name.decode() if isinstance(name, bytes) else name) != h.peer:
                raise ValueError(f"the grant is for NIXL agent {name!r}, not {h.peer!r}")
            peer.grants_loaded += 1
            n = len(h.remote_block_ids)
            remote = self.agent.prep_xfer_dlist(  # refused unless the grant covers them all
                h.peer, block_dlist(peer.base_ptr, h.remote_block_ids, block_bytes), "DRAM")
            h.impl = rd = NixlRead(None, remote)
            rd.req = self.agent.make_prepped_xfer(
                "READ", local_dlist, np.asarray(h.local_block_ids, dtype=np.int32),
                remote, np.arange(n, dtype=np.int32), notif_msg=notif)
            return self.agent.transfer(rd.req)
        except self.errors as e:  # NIXL raises nixlBackendError & co. for a dead peer
            return f"ERR ({type(e).__name__}: {e})"

    def check(self, h: XferHandle) -> str:
        """NIXL's status of a started READ: "DONE", "PROC" or what went wrong."""
        rd = h.impl
        assert isinstance(rd, NixlRead)
        try:
            return self.agent.check_xfer_state(rd.req)
        except self.errors as e:
            return f"ERR ({type(e).__name__}: {e})"

    def release(self, rd: NixlRead) -> bool:
        """Release (cancelling it if in flight) a READ's request, then its remote descriptors;
        False, and kept for a later retry, if NIXL could not release the request yet."""
        if rd.req is not None:
            try:
                rd.req.release()
            except self.errors as e:
                log.debug("NIXL: releasing a READ failed (will retry): %s", e)
                self.zombies.append(rd)
                return False
            rd.req = None
        if rd.remote is not None:
            try:
                rd.remote.release()
            except self.errors as e:
                log.debug("NIXL: releasing a READ's remote descriptors: %s", e)
            rd.remote = None
        return True

    def retry_zombies(self) -> None:
        zombies, self.zombies = self.zombies, []
        for rd in zombies:
            self.release(rd)  # puts it back if it still cannot be released
