"""X-Request-Id as the workers and the router accept it: a safe charset and a bounded length.

A client's id goes into response headers, logs and the engine's request ids; anything outside
`[A-Za-z0-9._:-]` (spaces, control characters, non-ASCII) is replaced by `_`, so a header value
can never end in whitespace or carry a byte HTTP forbids.
"""

from __future__ import annotations

import re

MAX_REQUEST_ID_CHARS = 128
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]+")


def clean_request_id(header: str | None) -> str | None:
    """The client's id made safe (runs of other characters -> `_`, at most 128 characters);
    None when the header is absent or blank."""
    if not header or not (header := header.strip()):
        return None
    return _UNSAFE.sub("_", header[:MAX_REQUEST_ID_CHARS * 4])[:MAX_REQUEST_ID_CHARS]
