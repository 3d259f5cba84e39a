"""A lean HTTP/1.1 transport for `httpx.AsyncClient` on plain asyncio streams.

Why: the router makes two upstream calls per request, and httpcore (anyio + h11) costs ~0.65 ms
per call on this machine, against ~0.1 ms for the same exchange on asyncio streams: with it the
router alone adds >3 ms per request and stalls near 70 req/s under concurrency (see
`duplexkv bench router_overhead`). The router keeps httpx's client API (timeouts, streaming,
Request/Response); only the wire part is replaced. `http://` only (https goes to httpcore).

    pool        idle keep-alive connections per (host, port), reused newest first; one that the
                server closed while idle is dropped, and a request whose reused connection dies
                before any answer byte is sent again once on a fresh connection
    framing     content-length, chunked (each chunk handed on as it arrives: SSE events are not
                batched), or read to EOF; 1xx skipped; HEAD/204/304 have no body
    timeouts    httpx's connect/read/write, via asyncio.timeout (no extra task per read)
    errors      mapped to httpx's ConnectError/ConnectTimeout/ReadTimeout/WriteTimeout/
                RemoteProtocolError/ReadError, so callers handle one family
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

_NO_BODY = (204, 304)
_MAX_IDLE_PER_HOST = 512


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @property
    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class _Body(httpx.AsyncByteStream):
    """A response body read off its connection; the connection goes back to the pool only when
    the body was read to its end and the server allows keep-alive."""

    def __init__(self, pool: FastTransport, key: tuple, conn: _Conn, framing: str,
                 length: int, keep_alive: bool, read_timeout: float | None) -> None:
        self.pool, self.key, self.conn = pool, key, conn
        self.framing, self.length, self.keep_alive = framing, length, keep_alive
        self.read_timeout = read_timeout
        self.complete = framing == "none"
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        r = self.conn.reader
        try:
            if self.framing == "length":
                left = self.length
                while left:
                    async with asyncio.timeout(self.read_timeout):
                        data = await r.read(min(left, 1 << 16))
                    if not data:
                        raise httpx.RemoteProtocolError("connection closed mid-body")
                    left -= len(data)
                    yield data
            elif self.framing == "chunked":
                while True:
                    async with asyncio.timeout(self.read_timeout):
                        line = await r.readuntil(b"\r\n")
                        size = int(line.split(b";", 1)[0].strip(), 16)
                        if size == 0:
                            while await r.readuntil(b"\r\n") != b"\r\n":  # trailers
                                pass
                            break
                        data = await r.readexactly(size + 2)
                    yield data[:-2]
            elif self.framing == "eof":
                while True:
                    async with asyncio.timeout(self.read_timeout):
                        data = await r.read(1 << 16)
                    if not data:
                        break
                    yield data
            self.complete = True
        except TimeoutError:
            raise httpx.ReadTimeout("timed out reading the response body") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            raise httpx.RemoteProtocolError(f"malformed or truncated response body: {e!r}") \
                from None
        except OSError as e:
            raise httpx.ReadError(repr(e)) from None

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.complete and self.keep_alive and self.framing != "eof":
            self.pool._release(self.key, self.conn)
        else:
            self.conn.close()


class FastTransport(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self._idle: dict[tuple, list[_Conn]] = {}

    async def _connect(self, key: tuple, timeout: float | None) -> _Conn:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(key[0], key[1], limit=1 << 20)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as e:
            raise httpx.ConnectError(f"{key[0]}:{key[1]}: {e}") from None
        return _Conn(reader, writer)

    def _acquire(self, key: tuple) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
            conn.close()
        return None

    def _release(self, key: tuple, conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if conn.usable and len(idle) < _MAX_IDLE_PER_HOST:
            idle.append(conn)
        else:
            conn.close()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.host, url.port or 80)
        timeouts = request.extensions.get("timeout", {})
        body = await request.aread()
        head = [f"{request.method} {url.raw_path.decode('ascii')} HTTP/1.1\r\n".encode()]
        for name, value in request.headers.raw:
            if name.lower() not in (b"transfer-encoding", b"content-length"):
                head.append(name + b": " + value + b"\r\n")
        if body or request.method in ("POST", "PUT", "PATCH"):
            head.append(b"content-length: %d\r\n" % len(body))
        payload = b"".join(head) + b"\r\n" + body
        conn = self._acquire(key)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(key, timeouts.get("connect"))
            try:
                return await self._exchange(request, key, conn, payload, timeouts)
            except _Stale:
                conn.close()
                if not reused:
                    raise httpx.RemoteProtocolError("server closed the connection without "
                                                    "answering") from None
                conn, reused = None, False  # the server dropped an idle connection: once more

    async def _exchange(self, request: httpx.Request, key: tuple, conn: _Conn, payload: bytes,
                        timeouts: dict) -> httpx.Response:
        r, w = conn.reader, conn.writer
        try:
            w.write(payload)
            if w.transport.get_write_buffer_size() > 1 << 16:
                async with asyncio.timeout(timeouts.get("write")):
                    await w.drain()
        except TimeoutError:
            conn.close()
            raise httpx.WriteTimeout("timed out sending the request") from None
        except OSError:
            raise _Stale() from None
        try:
            async with asyncio.timeout(timeouts.get("read")):
                while True:
                    raw = await r.readuntil(b"\r\n\r\n")
                    status, reason, headers = _parse_head(raw)
                    if status >= 200 or status == 101:
                        break
        except TimeoutError:
            conn.close()
            raise httpx.ReadTimeout("timed out waiting for the response") from None
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _Stale() from None
            conn.close()
            raise httpx.RemoteProtocolError("truncated response head") from None
        except (asyncio.LimitOverrunError, ValueError) as e:
            conn.close()
            raise httpx.RemoteProtocolError(f"malformed response head: {e!r}") from None
        except (ConnectionResetError, BrokenPipeError):
            raise _Stale() from None
        except OSError as e:
            conn.close()
            raise httpx.ReadError(repr(e)) from None
        fields = {k.lower(): v for k, v in headers}
        keep_alive = b"close" not in fields.get(b"connection", b"").lower()
        if request.method == "HEAD" or status in _NO_BODY:
            framing, length = "none", 0
        elif b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            framing, length = "chunked", 0
        elif b"content-length" in fields:
            framing, length = "length", int(fields[b"content-length"])
            if length == 0:
                framing = "none"
        else:
            framing, length = "eof", 0
        stream = _Body(self, key, conn, framing, length, keep_alive, timeouts.get("read"))
        if framing == "none":
            await stream.aclose()
        return httpx.Response(status, headers=headers, stream=stream,
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason})

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


class _Stale(Exception):
    """The connection died before the server answered anything."""


def _parse_head(raw: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    lines = raw[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    code, _, reason = rest.partition(b" ")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ValueError(f"bad header line: {line[:80]!r}")
        headers.append((name.strip(), value.strip()))
    return int(code), reason, headers
