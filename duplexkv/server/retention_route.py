"""`POST /v1/kv/retention` on a worker with KV transfer: the router renews the leases of the
conversations it sees active, deletes those that are over, and learns which entries this worker
has released (http/retention_sync.py has the wire format). Behind the worker's API key (the
router's `--worker-api-key`), like every path but /health, /metrics and /version."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from duplexkv.engine.async_engine import AsyncEngine
from duplexkv.http.body import read_body
from duplexkv.http.errors import APIError, bad_request, engine_unavailable
from duplexkv.http import retention_sync as rs

if TYPE_CHECKING:
    from duplexkv.kv.connector import KVConnector

MAX_BODY = 2 << 20
ENGINE_CALL_TIMEOUT_S = 5.0


def add_route(app: FastAPI, aeng: AsyncEngine, connector: KVConnector) -> None:
    @app.post("/v1/kv/retention")
    async def retention(request: Request) -> Response:
        try:
            req = rs.decode_request(await read_body(request, MAX_BODY))
        except APIError as e:
            return e.response()
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return bad_request(f"invalid retention request: {e}").response()
        reply, deleted = connector.sync_retention(req)  # thread-safe
        if deleted:  # free the blocks now (the engine thread owns them), not at the next poll
            if aeng.dead:
                return engine_unavailable(aeng.dead).response()
            try:
                await asyncio.wait_for(aeng.call(connector.release_deleted),
                                       ENGINE_CALL_TIMEOUT_S)
            except TimeoutError:
                pass  # released at the engine's next poll
        return Response(rs.encode(reply), media_type="application/json")
