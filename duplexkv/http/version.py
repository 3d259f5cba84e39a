"""`GET /version`, as vLLM answers it: `{"version": "<the package's version>"}` (open, like
/health: it names the software, nothing about the host)."""

from __future__ import annotations

from importlib import metadata

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


def package_version() -> str:
    import duplexkv

    v = getattr(duplexkv, "__version__", None)
    if isinstance(v, str) and v:
        return v
    try:
        return metadata.version("duplexkv")
    except metadata.PackageNotFoundError:
        return "unknown"


async def version_endpoint(_: Request) -> Response:
    return JSONResponse({"version": package_version()})
