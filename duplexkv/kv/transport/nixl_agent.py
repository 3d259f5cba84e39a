"""Creating the NIXL agent, and small NIXL helpers.

Why a progress thread: without one, a READ cannot complete until the *holder* progresses UCX.
NIXL flushes the endpoint after every transfer, and UCX's tcp transport (the only one that can
carry messages with peer-failure handling here) turns a flush after any earlier message, such as
the previous READ's notification, into a round trip the holder must answer. A holder busy in a
long forward pass would stall its readers for the whole pass (measured: a READ took as long as
the holder's loop interval, 50 ms -> 187 ms per READ at a 200 ms interval).

Why the agent is STRICT-synchronised: a holder registers and deregisters each claim's blocks on
the side-channel thread (`NixlGrants.expose`, nixl_grants.py) while the worker's loop READs on
the engine thread; NIXL's default (NONE) would leave that unsynchronised.

Why it must not spin: NIXL's Python wrapper (`nixl_agent`) hard-codes the progress thread's `pthrDelay` to 0, and the
UCX plugin's thread calls poll() on the UCX event fd with that timeout: 0 means it spins on a
core. `_progress_delay` substitutes, for the duration of the constructor, a config class whose
`pthrDelay` setter keeps our value; `make_agent` checks that it took effect and otherwise falls
back to no thread at all (never to a spinning one).
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _progress_delay(delay_us: int, seen: list):
    """Make `nixl_agent()` build its config with our pthrDelay instead of the hard-coded 0."""
    import nixl._api as api

    base = api.nixlBind.nixlAgentConfig
    prop = base.__dict__["pthrDelay"]

    def keep_ours(cfg, _value) -> None:
        prop.fset(cfg, delay_us)
        seen.append(delay_us)

    api.nixlBind.nixlAgentConfig = type("nixlAgentConfig", (base,),
                                        {"pthrDelay": property(prop.fget, keep_ours)})
    try:
        yield
    finally:
        api.nixlBind.nixlAgentConfig = base


def nixl_errors() -> tuple[type[BaseException], ...]:
    """The exception types NIXL's bindings raise (each derives from Exception directly)."""
    import nixl._bindings as b

    found = [getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error")]
    return (*(e for e in found if isinstance(e, type)), RuntimeError, ValueError)


def dlist(base: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    return block_dlist(base, range(num_blocks), block_bytes)


def block_dlist(base: int, block_ids, block_bytes: int) -> np.ndarray:
    """NIXL transfer descriptors (address, length, device 0) of whole blocks, in order."""
    ids = np.fromiter(block_ids, dtype=np.uint64)
    d = np.zeros((len(ids), 3), dtype=np.uint64)
    d[:, 0] = np.uint64(base) + ids * np.uint64(block_bytes)
    d[:, 1] = block_bytes
    return d


def empty_reg_dlist() -> object:
    """A registration list with no regions: partial metadata of connection info only."""
    import nixl._bindings as b

    return b.nixlRegDList(b.DRAM_SEG)


def make_agent(name: str, backends: list[str], thread_ms: float | None,
               errors: tuple, num_threads: int = 0) -> tuple[object, str, str | None]:
    """(agent, how UCX is progressed, warning or None). With `thread_ms`, NIXL's progress
    thread sleeps in poll() on UCX's event fd with that timeout instead of spinning."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    strict = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    if thread_ms is not None and thread_ms > 0:
        # the thread and the caller share the UCX worker: with UCX's default spinlock the
        # thread spins while the caller copies a READ (CMA runs inside transfer()), measured
        # 35-70 % of the copy speed; a mutex lets it sleep (UCX reads this when NIXL starts it)
        os.environ.setdefault("UCX_USE_MT_MUTEX", "y")
        seen: list = []
        delay_us = max(1000, int(thread_ms * 1000))
        try:
            with _progress_delay(delay_us, seen):
                agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True,
                                                           backends=backends,
                                                           num_threads=num_threads,
                                                           sync_mode=strict))
            if seen:
                how = f"event-driven progress thread (poll timeout {delay_us // 1000} ms)"
                return agent, how, None
            del agent  # the wrapper did not take our delay: its thread would spin
        except (*errors, KeyError, TypeError, AttributeError) as e:
            log.debug("cannot set the NIXL progress thread delay: %s", e)
        warning = ("could not give NIXL's progress thread a poll timeout; running without it: "
                   "READs complete only when the holder's loop calls get_notifs()")
    else:
        warning = None
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=backends,
                                                 num_threads=num_threads, sync_mode=strict))
    return agent, "no progress thread: the worker's loop progresses UCX", warning
