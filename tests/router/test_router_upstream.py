"""The router's HTTP client of its workers (`rivulet/router/upstream.py`) and the end of a stream whose client
goes away: kept-alive connections, the read timeout, a reused connection the worker had closed, bad HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable

import httpx
import pytest

from fake_worker import FakeWorker, ThreadServer
from rivulet.router.app import build_router
from rivulet.router.upstream import ConnectError, ResponseError, Upstream
from test_router_proxy import router_args

STREAM = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_connections_are_kept_alive_and_a_cut_answer_closes_its_connection() -> None:
    w = FakeWorker("a", tpot=0.05)

    async def main() -> None:
        c = Upstream()
        for _ in range(4):  # streamed and plain answers read to their end: one connection for all
            r = await c.request("POST", w.url, "/v1/completions", STREAM)
            body = await r.read()
            r.release()
            assert r.status == 200 and body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") == 5
            r = await c.request("GET", w.url, "/health")
            assert (r.status, await r.read()) == (200, b"")
            r.release()
        assert c.connections_opened == 1 and w.state.streams_cut == 0
        # an answer closed after its first piece: the worker sees its client go, the next request connects anew
        r = await c.request("POST", w.url, "/v1/completions", json.dumps(
            {"prompt": "hi", "max_tokens": 100, "stream": True}).encode())
        async for piece in r:
            assert piece.startswith(b"data: ")
            break
        r.close()
        await asyncio.to_thread(wait_until, lambda: w.state.streams_cut == 1)
        r = await c.request("GET", w.url, "/health")
        await r.read()
        r.release()
        assert c.connections_opened == 2
        await c.close()
    try:
        asyncio.run(main())
    finally:
        w.stop()


def test_read_timeout_and_unreachable_worker() -> None:
    w = FakeWorker("a", tpot=2.0)

    async def main() -> None:
        c = Upstream(read_timeout=0.3)
        r = await c.request("POST", w.url, "/v1/completions", STREAM)  # the first event comes at once
        t0 = time.monotonic()
        with pytest.raises(ResponseError, match="no byte from the worker for 0.3 s"):
            await r.read()
        assert time.monotonic() - t0 < 1.5
        r.close()
        with pytest.raises(ConnectError):
            await c.request("GET", "http://127.0.0.1:9", "/health")  # nothing listens on the discard port
        await c.close()
    try:
        asyncio.run(main())
    finally:
        w.stop()


async def raw_server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
                     ) -> tuple[asyncio.Server, str, list[int]]:
    """A TCP server speaking whatever `handle` writes; `handle` gets the connection's number."""
    conns: list[int] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(len(conns))
        await handle(reader, writer, conns[-1])

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", conns


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(n)


def test_a_kept_connection_the_worker_dropped_is_replaced_a_body_to_eof_is_read_and_bad_http_is_an_error() -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            await read_request(reader)  # the first request of every connection is answered, keep-alive
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")
            await writer.drain()
            try:
                await read_request(reader)  # a second one on the same connection: closed unanswered
            except asyncio.IncompleteReadError:
                pass
            writer.close()

        server, url, conns = await raw_server(handle)
        c = Upstream()
        for _ in range(3):
            r = await c.request("POST", url, "/x", b"{}")
            assert (r.status, await r.read(), r.headers["content-type"]) == (200, b"{}", "application/json")
            r.release()
        assert len(conns) == 3  # each reuse met a closed connection and went on a new one, unseen by the caller
        server.close()

        async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            await read_request(reader)
            writer.write(b"SMTP ready\r\n\r\n")
            await writer.drain()

        async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            await read_request(reader)  # HTTP/1.0 style: no length, the body ends with the connection
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
            await writer.drain()
            writer.close()

        server, url, _ = await raw_server(until_close)
        r = await c.request("GET", url, "/health")
        assert (r.status, await r.read()) == (200, b"all of it")
        r.release()
        server.close()

        server, url, _ = await raw_server(garbage)
        with pytest.raises(ResponseError, match="not valid HTTP"):
            await c.request("GET", url, "/health")
        server.close()
        await c.close()
    asyncio.run(main())


def test_a_client_that_goes_away_ends_the_workers_stream() -> None:
    w = FakeWorker("a", tpot=0.05)
    router = build_router(router_args("--worker-urls", w.url, "--health-check-interval-secs", "0.2"))
    server = ThreadServer(router.app)
    body: dict[str, Any] = {"prompt": "hello", "max_tokens": 200, "stream": True}
    try:
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
            # the router saw the disconnect, cancelled its relay and closed the worker's connection
            wait_until(lambda: w.state.streams_cut == 1, 5.0)
            assert router.pool.workers[w.url].in_flight == 0
            # and it keeps serving
            with client.stream("POST", server.url + "/v1/completions", json={**body, "max_tokens": 3}) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert len(events) == 4 and events[-1] == "data: [DONE]"
    finally:
        server.stop()
        w.stop()
