"""Request bodies at the edge: bounded reads and JSON checked for depth and valid Unicode.

Shared by the worker and the router. A body over the limit is refused before it is read whole
(413); JSON nested deeper than `MAX_DEPTH`, or holding a string that is not valid Unicode (a lone
surrogate written as an escape), is a 400 naming where, so nothing downstream (tokenizers,
templates, response encoding) ever sees such a value.
"""

from __future__ import annotations

from starlette.requests import Request

from duplexkv.server.errors import APIError, bad_request

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
MAX_DEPTH = 64


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes; "
                         f"see --max-request-bytes).", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or APIError 413 as soon as it exceeds `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_value(value: object, max_depth: int = MAX_DEPTH) -> None:
    """400 for nesting deeper than `max_depth` or a string (key or value) that is not valid
    Unicode. Iterative, so no depth can overflow the stack."""
    stack: list[tuple[object, int, str]] = [(value, 1, "")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, (dict, list)):
            if depth > max_depth:
                raise bad_request(f"The request body is nested deeper than {max_depth} levels.")
            if isinstance(v, dict):
                for k, item in v.items():
                    path = f"{where}.{k}" if where else str(k)
                    _check_text(k, path)
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, depth + 1, path))
            else:
                for i, item in enumerate(v):
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, depth + 1, f"{where}[{i}]"))


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        shown = where[:80].encode("utf-8", "replace").decode()
        raise bad_request(f"`{shown or 'body'}` is not valid Unicode (it holds a lone surrogate).",
                          shown or None) from None
