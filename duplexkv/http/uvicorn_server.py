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


def bounded_server(app, host: str, port: int, limits, collapse_logs: bool = True,
                   **config) -> CleanExitServer:
    """A CleanExitServer whose connections are bounded by `limits`
    (duplexkv.http.connections.ConnectionLimits), with repeated log lines collapsed: a filter
    on the process's log handlers, so `collapse_logs=False` for a server inside another program
    (a test's, whose log capture it would otherwise filter for the rest of the session)."""
    from duplexkv.http.connections import bounded_protocol
    from duplexkv.http.log_repeats import collapse_repeats

    protocol, gate = bounded_protocol(limits)
    server = CleanExitServer(uvicorn.Config(app, host=host, port=port, http=protocol,
                                            log_level="warning", access_log=False,
                                            timeout_graceful_shutdown=5, **config))
    server.connection_gate = gate
    if collapse_logs:
        collapse_repeats()  # after uvicorn.Config: it installs uvicorn's handlers
    log.info("connections: at most %d open, %d without a complete request; %g s to send a "
             "request", limits.max_connections, limits.max_pending, limits.request_timeout_s)
    return server
