"""The router's HTTP/1.1 client of its workers: keep-alive connections per worker, answers parsed by httptools.

Made for the relay's hot path: a streamed answer's body is handed over in the pieces the socket
delivers, with no timer re-armed per piece (one watchdog per connection checks the read timeout),
and an answer read to its end leaves its connection idle for the worker's next request. An answer
closed before its end closes its connection, so the worker sees the client go and aborts.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import AsyncIterator
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20  # bytes of unread body after which the socket stops being read


class ConnectError(OSError):
    """The worker could not be reached: refused, unresolvable, or no connection within the connect timeout."""


class ResponseError(Exception):
    """The answer broke off: the connection dropped, the worker broke HTTP, or no byte came within the read timeout."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker and the answer it is reading."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float) -> None:
        self.loop, self.read_timeout = loop, read_timeout
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.received = False  # any byte of this answer
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.busy = False
        self.last_read = 0.0

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ResponseError(f"the worker's answer is not valid HTTP: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if (self.busy and not self.complete and exc is None and self.status is not None and self.error is None
                and "content-length" not in self.headers and "chunked" not in self.headers.get("transfer-encoding", "")):
            self.complete = True  # a body without a length or chunks ends where the connection does
        if self.busy and not self.complete and self.error is None:
            self.error = ResponseError(f"the worker closed the connection mid-answer{f': {exc}' if exc else ''}")
        self._stop_watchdog()
        self._wake()

    # ---- httptools callbacks ----

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._stop_watchdog()
        self._wake()

    # ---- the reading side ----

    def start(self, request: bytes) -> None:
        """Send one request on this (idle) connection."""
        self._reset()
        self.busy = True
        if self.lost or self.transport is None:
            self.error = ResponseError("the connection to the worker is closed")
            return
        self.transport.write(request)
        self.last_read = self.loop.time()
        self._watchdog = self.loop.call_later(self.read_timeout, self._check_timeout)

    async def wait(self) -> None:
        """Until something happens: a header block, a body piece, the end, or a failure."""
        if self.error is not None:
            raise self.error
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        data = self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)
        self.pieces.clear()
        if self.buffered > _HIGH_WATER and self.transport is not None and not self.lost:
            self.transport.resume_reading()
        self.buffered = 0
        return data

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self.abort()
        self._wake()

    def abort(self) -> None:
        self.lost = True
        self._stop_watchdog()
        if self.transport is not None:
            self.transport.abort()

    def _check_timeout(self) -> None:
        self._watchdog = None
        if not self.busy or self.complete or self.lost:
            return
        left = self.last_read + self.read_timeout - self.loop.time()
        if left > 0:
            self._watchdog = self.loop.call_later(left, self._check_timeout)
        else:
            self._fail(ResponseError(f"no byte from the worker for {self.read_timeout:g} s"))

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None


class Response:
    """A worker's answer: `status` and `headers` (lower-case names) read, the body open. Iterate it for the
    body's pieces, or `read()` it whole; then `release()` (its connection is kept if the body was read to
    its end) or `close()` (the connection is dropped, so the worker sees the request go)."""

    def __init__(self, client: Upstream, key: tuple[str, int, bool], conn: _Connection) -> None:
        self._client, self._key, self._conn = client, key, conn
        self.status: int = conn.status or 0
        self.headers = conn.headers
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.pieces:
                yield conn.take()
            elif conn.complete:
                return
            else:
                await conn.wait()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self])

    def release(self) -> None:
        if self.closed:
            return
        self.closed = True
        conn = self._conn
        conn.busy = False
        if conn.complete and conn.keep_alive and not conn.lost and conn.error is None:
            self._client._idle_put(self._key, conn)
        else:
            conn.abort()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._conn.busy = False
            self._conn.abort()


class Upstream:
    """Keep-alive HTTP/1.1 connections to the workers (http or https), reused in LIFO order; a connection
    idle for `idle_timeout` seconds (below uvicorn's own keep-alive of 5 s) is dropped rather than reused."""

    def __init__(self, connect_timeout: float = 5.0, read_timeout: float = 1800.0, idle_timeout: float = 2.0) -> None:
        self.connect_timeout, self.read_timeout, self.idle_timeout = connect_timeout, read_timeout, idle_timeout
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._targets: dict[str, tuple[tuple[str, int, bool], str]] = {}
        self._closed = False
        self.connections_opened = 0

    def _target(self, base_url: str) -> tuple[tuple[str, int, bool], str]:
        t = self._targets.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            tls = u.scheme == "https"
            if u.hostname is None or u.scheme not in ("http", "https"):
                raise ConnectError(f"not an http(s) URL: {base_url!r}")
            port = u.port or (443 if tls else 80)
            t = self._targets[base_url] = ((u.hostname, port, tls), u.netloc)
        return t

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, content_type: str = "application/json") -> Response:
        """Send one request and read the answer's status and headers; the body stays open on the Response.
        Raises ConnectError when no connection could be made, ResponseError when the answer broke off."""
        key, host = self._target(base_url)
        head = [f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"]
        if body or method in ("POST", "PUT"):
            head.append(f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n")
        for k, v in (headers or {}).items():
            if "\r" not in v and "\n" not in v:
                head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        conn = self._idle_get(key)
        if conn is not None:
            try:
                return await self._exchange(key, conn, data)
            except ResponseError:
                if conn.received:
                    raise
                # the worker closed this idle connection as the request went out: it never saw it
        return await self._exchange(key, await self._connect(key), data)

    async def _exchange(self, key: tuple[str, int, bool], conn: _Connection, data: bytes) -> Response:
        conn.start(data)
        try:
            while conn.status is None:
                await conn.wait()
        except BaseException:
            conn.abort()
            raise
        return Response(self, key, conn)

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        if self._closed:
            raise ConnectError("the client is closed")
        loop = asyncio.get_running_loop()
        host, port, tls = key
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop, self.read_timeout), host, port,
                                       ssl=ssl.create_default_context() if tls else None),
                self.connect_timeout)
        except asyncio.TimeoutError as e:
            raise ConnectError(f"no connection to {host}:{port} within {self.connect_timeout:g} s") from e
        except OSError as e:
            raise ConnectError(f"cannot connect to {host}:{port}: {e}") from e
        self.connections_opened += 1
        return conn

    def _idle_get(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.idle_timeout:
                return conn
            conn.abort()
        return None

    def _idle_put(self, key: tuple[str, int, bool], conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(key, [])
        if idle and time.monotonic() - idle[0].idle_since >= self.idle_timeout:  # drop the stale end of the list
            keep = [c for c in idle if not c.lost and conn.idle_since - c.idle_since < self.idle_timeout]
            for c in idle:
                if c not in keep:
                    c.abort()
            idle[:] = keep
        idle.append(conn)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
