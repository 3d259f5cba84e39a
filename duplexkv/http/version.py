"""`GET /version`, as vLLM answers it: `{"version": "<the package's version>"}` (open, like
/health: it names the software, nothing about the host)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from duplexkv.version import __version__


def package_version() -> str:
    return __version__


async def version_endpoint(_: Request) -> Response:
    return JSONResponse({"version": package_version()})
