"""Calls to workers on a turn's behalf, and what their failures do to the worker's state.

    send         POST with the turn's request id and the router's worker key (never the
                 client's), its time added to the turn's wait. A refused or timed-out
                 connection marks the worker down; a worker marked down while the call is in
                 flight (a probe of the liveness watch, liveness.py, or a health check: hung,
                 host unreachable, partitioned) has the call abandoned; both raise Unreachable
                 (nothing was answered). Another transport error makes the worker suspect
                 (probed at once) and is counted and raised as it is (httpx.HTTPError).
    bad_status   an answer that is not a usable 200: counted (a 4xx is the client's fault, not
                 the worker's), a 503 marks the worker down (its engine is not available),
                 another 5xx makes it suspect
Client-visible messages name a worker by role and index ("prefill[0]"), never by its URL, and
carry no exception text (which can hold addresses); the log has the details. Which failure is
retried where is retry.py's; the caller counts the leg in the worker's `outstanding`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx
from starlette.responses import Response

from duplexkv.http.errors import APIError
from duplexkv.router.backends import Backend
from duplexkv.router.legs import dumps
from duplexkv.router.liveness import Liveness, WentDown
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.turn.context import Turn
from duplexkv.router.upstream import Upstream

log = logging.getLogger("duplexkv.router")
perf = time.perf_counter


class Unreachable(Exception):
    """The request never reached the worker."""


@dataclass(slots=True)
class Relayed(Exception):
    """A worker's error answer, passed to the client as it is."""

    status: int
    content: bytes
    media_type: str

    @classmethod
    def of(cls, resp: httpx.Response) -> Relayed:
        return cls(resp.status_code, resp.content,
                   resp.headers.get("content-type", "application/json"))

    def response(self, request_id: str) -> Response:
        return Response(self.content, self.status, media_type=self.media_type,
                        headers={"X-Request-Id": request_id})


def no_worker(role: str, detail: str) -> APIError:
    return APIError(503, f"No {role} worker could serve the request: {detail}",
                    type="service_unavailable_error")


class WorkerCalls:
    def __init__(self, upstream: Upstream, metrics: RouterMetrics,
                 worker_headers: dict[str, str], liveness: Liveness) -> None:
        self.upstream, self.metrics = upstream, metrics
        self.liveness = liveness
        self.worker_headers = worker_headers  # never the client's Authorization

    def _headers(self, turn: Turn) -> dict[str, str]:
        return {"content-type": "application/json", "x-request-id": turn.request_id,
                **self.worker_headers}

    async def send(self, b: Backend, turn: Turn, body: dict, stream: bool = False,
                   path: str | None = None) -> httpx.Response:
        """POST `body` to `b` (the turn's endpoint unless `path`); with `stream` only the
        headers are read (the caller reads and closes the body)."""
        t = perf()
        try:
            resp = await self.liveness.guard(b, self.upstream.post(
                b.url + (path or turn.req.path), dumps(body), self._headers(turn), stream=stream))
        except WentDown:
            b.note_error()
            log.warning("%s: %s (%s) went down during the request; abandoned",
                        turn.request_id, b.name, b.url)
            self.metrics.upstream_errors.labels(b.role, "went_down").inc()
            raise Unreachable(f"{b.name}: went down during the request") from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            b.note_error()
            log.warning("%s: %s (%s) unreachable: %r", turn.request_id, b.name, b.url, e)
            b.mark_down(f"connection failed ({type(e).__name__})")
            self.metrics.upstream_errors.labels(b.role, "connect").inc()
            raise Unreachable(f"{b.name}: connection failed ({type(e).__name__})") from e
        except httpx.HTTPError as e:
            b.note_error(type(e).__name__)
            log.warning("%s: %s (%s) failed: %r", turn.request_id, b.name, b.url, e)
            self.liveness.suspect(b, f"a leg failed ({type(e).__name__})")
            self.metrics.upstream_errors.labels(b.role, "transport").inc()
            raise
        finally:
            turn.waited.seconds += perf() - t
        b.progressed()
        return resp

    def bad_status(self, b: Backend, resp: httpx.Response) -> str:
        """Account for an answer that is not a usable 200; -> what the client's 503 says."""
        self.metrics.upstream_errors.labels(b.role, f"http_{resp.status_code // 100}xx").inc()
        if not 400 <= resp.status_code < 500:
            b.note_error(f"HTTP {resp.status_code}")
        if resp.status_code == 503:
            b.mark_down("answered 503 (engine not available)")
        elif resp.status_code >= 500:
            self.liveness.suspect(b, f"answered HTTP {resp.status_code}")
        log.warning("%s (%s) answered HTTP %d: %s", b.name, b.url, resp.status_code,
                    resp.text[:300])
        return f"{b.name} answered HTTP {resp.status_code}"

