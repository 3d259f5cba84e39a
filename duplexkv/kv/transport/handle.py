"""One READ as its caller sees it: the handle `KVTransport.read` returns, its states, and the
counters every transport keeps of the handles that finished (shown in `health()`)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class XferHandle:
    """One READ. Owned by the transport that made it; pass it back to `poll` / `release`.

    `state` and `error` are updated by `poll`; read them after polling. `impl` is private to the
    transport (a NIXL request, a TCP job).
    """

    peer: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    nbytes: int
    deadline: float  # time.monotonic() after which the read counts as failed
    started: float = field(default_factory=time.monotonic)
    state: XferState = XferState.PENDING
    error: str | None = None
    finished: float | None = None  # time.monotonic() when DONE/FAILED was first seen
    impl: object = field(default=None, repr=False)
    token: bytes = field(default=b"", repr=False)  # the holder's capability for this READ
    grant: bytes = field(default=b"", repr=False)  # what the holder exposed for it (NIXL)
    stalled: bool = False  # FAILED because no byte moved for the transport's stall_s (TCP)

    @property
    def elapsed_s(self) -> float:
        return (self.finished if self.finished is not None else time.monotonic()) - self.started


@dataclass(slots=True)
class TransferStats:
    """Counters every transport keeps and reports in `health()`."""

    reads: int = 0
    reads_done: int = 0
    reads_failed: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    last_read_ms: float | None = None
    last_read_gbps: float | None = None
    last_error: str | None = None
    notifs_sent: int = 0
    notifs_received: int = 0

    def finished(self, h: XferHandle) -> None:
        """Count a handle that just became DONE or FAILED."""
        if h.state is XferState.DONE:
            self.reads_done += 1
            self.bytes_read += h.nbytes
            self.read_seconds += h.elapsed_s
            self.last_read_ms = round(h.elapsed_s * 1e3, 3)
            if h.nbytes and h.elapsed_s > 0:
                self.last_read_gbps = round(h.nbytes / h.elapsed_s / 1e9, 3)
        elif h.state is XferState.FAILED:
            self.reads_failed += 1
            self.last_error = h.error

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["read_seconds"] = round(self.read_seconds, 6)
        return d
