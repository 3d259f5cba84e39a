"""Request bodies at the edge: bounded reads and strict JSON.

Shared by the worker and the router. A body over the limit is refused before it is read whole
(413). The JSON must be strict enough to be used and passed on as it is: no NaN or Infinity (nor
a number that overflows to it), no integer too long to convert, at most `max_depth` levels of
nesting, and valid Unicode in every key and string (a lone surrogate escape such as `"\\ud800"`
decodes to a str that cannot be encoded again). Each is a 400 that names the field, never the
offending value, so nothing downstream (tokenizers, templates, response encoding) sees such a
value.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from duplexkv.http.errors import APIError, bad_request

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_MAX_JSON_DEPTH = 64


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes; "
                         f"see --max-request-bytes).")


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


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict:
    """A JSON object that can be used and re-encoded as it is, or a 400."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:  # deeper than the interpreter's stack allows
        raise _too_deep(max_depth, None) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    _check_tree(body, max_depth)
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e999: valid JSON syntax, but no double holds it
        raise ValueError(f"the number {text[:40]} is out of range")
    return v


def _too_deep(max_depth: int, param: str | None) -> APIError:
    return bad_request(f"The request body is nested too deeply (more than {max_depth} levels).",
                       param)


def _bad_unicode(param: str | None) -> APIError:
    where = f" in `{param}`" if param else " in a key"
    return bad_request(f"The request body contains invalid Unicode (a lone surrogate){where}.",
                       param)


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


_SCALARS = frozenset((int, float, bool, type(None)))


def _check_tree(body: dict, max_depth: int) -> None:
    """Depth and Unicode of every value, without recursion; `param` paths are built only for
    containers and for the one bad string (token id lists stay cheap)."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth, path.split(".")[0].split("[")[0] or None)
        if isinstance(node, dict):
            for k, v in node.items():
                if not _encodable(k):
                    raise _bad_unicode(path or None)
                if isinstance(v, str):
                    if not _encodable(v):
                        raise _bad_unicode(f"{path}.{k}" if path else k)
                elif isinstance(v, (dict, list)):
                    stack.append((v, depth + 1, f"{path}.{k}" if path else k))
        elif not _SCALARS.issuperset(map(type, node)):  # token ids: one pass in C
            for i, v in enumerate(node):
                if isinstance(v, str):
                    if not _encodable(v):
                        raise _bad_unicode(f"{path}[{i}]")
                elif isinstance(v, (dict, list)):
                    stack.append((v, depth + 1, f"{path}[{i}]"))
