"""The holder's side of a NIXL claim: exactly the claim's blocks registered while it lives.

A NIXL READ never reaches the holder's code, so the holder cannot check a token per READ as the
TCP transport does. Instead nothing of the pool is published (the transport's metadata carries
connection info only), and when a claim is made the holder registers exactly the claim's blocks
(`expose`, one region per run of consecutive blocks) and returns their partial metadata, the
grant, with the verify reply; the reader loads it and prepares descriptors for just the blocks
it READs. When the claim ends (done, skip, release, expiry, lapse) the holder deregisters it
(`withdraw`). Both run on the side-channel thread while the engine thread READs: the agent is
STRICT-synchronised (nixl_agent.py) and the table of grants has its own lock.
"""

from __future__ import annotations

import logging
import threading
import time

from duplexkv.kv.transport.layout import PoolLayout, runs

log = logging.getLogger(__name__)


class NixlGrants:
    def __init__(self, agent, errors: tuple[type[BaseException], ...]) -> None:
        self.agent, self.errors = agent, errors
        self._regs: dict[bytes, object] = {}  # claim token -> its nixlRegDList
        self._lock = threading.Lock()
        self._closed = False
        self.issued = 0
        self.seconds = 0.0  # time spent registering claims and deregistering them

    def expose(self, layout: PoolLayout, token: bytes, block_ids: tuple[int, ...]) -> bytes:
        """Register `block_ids` of the pool for the claim `token`; -> the grant (b"" for no
        blocks). A token exposed again replaces its old registration."""
        if not block_ids:
            return b""
        regions = [(layout.base_ptr + b * layout.block_bytes, n * layout.block_bytes, 0, "")
                   for b, n in runs(block_ids)]
        t0 = time.perf_counter()
        with self._lock:
            reg = self.agent.register_memory(regions, "DRAM", ["UCX"])
            try:
                grant = self.agent.get_partial_agent_metadata(reg, False, ["UCX"])
            except self.errors:
                self.agent.deregister_memory(reg, ["UCX"])
                raise
            old = self._regs.pop(bytes(token), None)
            self._regs[bytes(token)] = reg
            self.issued += 1
            if old is not None:
                self.agent.deregister_memory(old, ["UCX"])
            self.seconds += time.perf_counter() - t0
        return bytes(grant)

    def withdraw(self, token: bytes) -> None:
        """Deregister the claim's blocks; unknown tokens are ignored."""
        with self._lock:
            reg = self._regs.pop(bytes(token), None)
            if reg is not None and not self._closed:
                t0 = time.perf_counter()
                try:
                    self.agent.deregister_memory(reg, ["UCX"])
                except self.errors as e:
                    log.warning("NIXL: deregistering a claim's blocks failed: %s", e)
                self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Deregister every grant (the transport is closing); later withdraws do nothing."""
        with self._lock:
            regs, self._regs, self._closed = list(self._regs.values()), {}, True
        for reg in regs:
            self.agent.deregister_memory(reg, ["UCX"])

    def health(self) -> dict:
        return {"exposed_claims": len(self._regs), "grants_issued": self.issued,
                "grant_ms_per_claim": round(self.seconds * 1e3 / max(1, self.issued), 4)}
