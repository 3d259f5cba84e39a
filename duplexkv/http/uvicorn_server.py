"""uvicorn, exiting cleanly on SIGINT/SIGTERM (shared by the worker and the router)."""

from __future__ import annotations

import contextlib
import logging
import signal

import uvicorn

log = logging.getLogger(__name__)


class CleanExitServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """Like uvicorn's, minus re-raising the signal afterwards (we exit cleanly)."""
        sigs = (signal.SIGINT, signal.SIGTERM)
        old = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def handle_exit(self, sig, frame) -> None:
        log.info("%s: shutting down", signal.Signals(sig).name)
        super().handle_exit(sig, frame)
