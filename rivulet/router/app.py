"""``rivulet router``: an OpenAI-compatible HTTP front over OpenAI-compatible workers (Rivulet or vLLM).

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (routed by the policy, retried,
streams resumed on failure), ``/v1/models``, ``/tokenize``, ``/detokenize`` (any available
worker), ``/health`` (200 while some worker is available), ``/metrics`` (the router's own), and
``/workers``: ``GET`` lists them, ``POST {"url": ...}`` adds one, ``DELETE {"url": ...}`` (or
``?url=``) removes one. This module imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

import uvicorn

from rivulet.router.metrics import RouterMetrics
from rivulet.router.policies import POLICIES, CacheAware, CacheAwareConfig, Policy, RouteInput
from rivulet.router.proxy import FORWARDED_HEADERS, Answer, RetryConfig, Router, UpstreamError
from rivulet.router.upstream import ConnectError, ResponseError
from rivulet.router.workers import BreakerConfig, HealthConfig, WorkerPool

logger = logging.getLogger("rivulet.router")

GENERATE = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
_FORWARDED = tuple(h.encode() for h in FORWARDED_HEADERS)
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class HTTPError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> bytes:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return json.dumps({"error": {"message": self.message, "type": kind, "param": self.param,
                                     "code": self.code}}).encode()


class Request:
    """The little of an ASGI HTTP request the handlers read."""

    __slots__ = ("scope", "receive", "_body")

    def __init__(self, scope: dict[str, Any], receive: Receive) -> None:
        self.scope, self.receive = scope, receive
        self._body: bytes | None = None

    @property
    def path(self) -> str:
        return self.scope["path"]

    @property
    def method(self) -> str:
        return self.scope["method"]

    def header(self, name: bytes) -> str | None:
        for k, v in self.scope["headers"]:
            if k == name:
                return v.decode("latin-1")
        return None

    def forwarded_headers(self) -> dict[str, str]:
        """The client headers a worker should see."""
        return {k.decode(): v.decode("latin-1") for k, v in self.scope["headers"] if k in _FORWARDED}

    def query(self, name: str) -> str | None:
        values = parse_qs(self.scope.get("query_string", b"").decode("latin-1")).get(name)
        return values[0] if values else None

    async def body(self) -> bytes:
        if self._body is None:
            chunks = []
            while True:
                m = await self.receive()
                if m["type"] == "http.disconnect":
                    raise _ClientGone()
                chunks.append(m.get("body", b""))
                if not m.get("more_body"):
                    break
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> dict[str, Any]:
        """The body as a JSON object (HTTPError 400 when it is not one)."""
        try:
            body = json.loads(await self.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body


async def respond(send: Send, status: int, body: bytes = b"", content_type: str | None = "application/json",
                  headers: dict[str, str] | None = None) -> None:
    head = [(b"content-length", str(len(body)).encode())]
    if content_type is not None and body:
        head.append((b"content-type", content_type.encode("latin-1")))
    head += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def relay_answer(send: Send, answer: Answer) -> None:
    """A worker's whole answer, as it came (its content type, `Retry-After` and `X-Request-Id`)."""
    h = answer.headers
    await respond(send, answer.status, answer.body, h.get("content-type"),
                  {k: v for k, v in h.items() if k != "content-type"})


async def respond_json(send: Send, obj: Any, status: int = 200) -> None:
    await respond(send, status, json.dumps(obj).encode())


def route_input(kind: str, body: dict[str, Any], session: str | None) -> RouteInput:
    """The text a policy routes on: the prompt (the first of a batch), or the conversation's messages."""
    if kind == "chat":
        parts = []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
                parts.append(f"{m.get('role')}: {content or ''}\n")
        text = "".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else ",".join(map(str, prompt)) if isinstance(prompt, list) else ""
    user = body.get("user")
    return RouteInput(text, session if session is not None else user if isinstance(user, str) else None)


def with_token_ids(raw: bytes, body: dict[str, Any]) -> bytes:
    """The request's bytes with ``"return_token_ids": true``: spliced before the closing brace when the client
    did not name the field (no re-encoding on the hot path), re-encoded when it did."""
    if body and "return_token_ids" not in body:
        end = raw.rstrip()
        if end.endswith(b"}"):
            return end[:-1] + b',"return_token_ids":true}'
    return json.dumps({**body, "return_token_ids": True}, separators=(",", ":")).encode()


Handler = Callable[[Request, Send], Awaitable[None]]


class RouterApp:
    """The router's state and its HTTP handlers: a plain ASGI application (no framework between uvicorn and
    the relay: on 2 cores at 64 streams, Starlette's per-response task group and middleware cost more CPU than
    the relay itself)."""

    def __init__(self, pool: WorkerPool, policy: Policy, retry: RetryConfig, session_header: str = "x-session-id",
                 read_timeout: float = 1800.0, maintain_interval: float = 60.0) -> None:
        self.pool, self.policy = pool, policy
        self.metrics = RouterMetrics()
        self.metrics.watch(lambda: self.pool)
        self.router = Router(pool, policy, retry, self.metrics, read_timeout)
        self.session_header = session_header.lower().encode("latin-1")
        self.maintain_interval = maintain_interval
        self.routes: dict[str, tuple[tuple[str, ...], Handler]] = {
            "/v1/completions": (("POST",), self.generate),
            "/v1/chat/completions": (("POST",), self.generate),
            "/v1/models": (("GET",), self.models),
            "/tokenize": (("POST",), self.passthrough),
            "/detokenize": (("POST",), self.passthrough),
            "/health": (("GET",), self.health),
            "/metrics": (("GET",), self.render_metrics),
            "/workers": (("GET", "POST", "DELETE"), self.workers),
        }
        self._maintainer: asyncio.Task[None] | None = None

    @property
    def app(self) -> RouterApp:
        """The ASGI application (this object)."""
        return self

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = self.routes.get(scope["path"])
            try:
                if route is None:
                    raise HTTPError(404, f"no route {scope['path']}")
                methods, handler = route
                if scope["method"] not in methods:
                    raise HTTPError(405, f"{scope['method']} is not allowed on {scope['path']} ({', '.join(methods)})")
                await handler(Request(scope, receive), send)
            except HTTPError as e:
                await respond(send, e.status, e.body())
            except _ClientGone:
                pass
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.pool.start()
                self._maintainer = asyncio.create_task(self._maintain())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._maintainer is not None:
                    self._maintainer.cancel()
                    await asyncio.gather(self._maintainer, return_exceptions=True)
                await self.pool.close()
                await self.router.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.maintain_interval)
            self.policy.maintain()

    async def generate(self, request: Request, send: Send) -> None:
        start = time.perf_counter()
        path = request.path
        kind = GENERATE[path]
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        route = route_input(kind, body, request.header(self.session_header))
        headers = request.forwarded_headers()
        stream = bool(body.get("stream"))
        worker_body = with_token_ids(raw, body) if stream else raw  # the client's bytes, passed through
        try:
            answer = await self.router.send(path, worker_body, headers, route, stream)
        except UpstreamError as e:
            self.metrics.requests.labels("none", str(e.status)).inc()
            raise HTTPError(e.status, e.message, e.code) from e
        self.metrics.decisions.labels(self.policy.name, self.policy.last_reason).inc()
        self.metrics.first_byte.observe(time.perf_counter() - start)
        self.metrics.requests.labels(answer.worker.url, str(answer.status)).inc()
        if answer.stream is None:
            return await relay_answer(send, answer)
        events = self.router.relay(kind, path, body, worker_body, headers, answer)
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        # A client that goes away cancels this task: the relay's cleanup closes the worker's stream (the worker
        # aborts the request). uvicorn answers `receive` with a disconnect when the client drops the connection.
        task, finished = asyncio.current_task(), False
        watch = asyncio.ensure_future(request.receive())
        watch.add_done_callback(lambda _: None if finished or task is None else task.cancel())
        try:
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            if not watch.done() or task is None:
                raise
            task.uncancel()
        finally:
            finished = True
            watch.cancel()
            await events.aclose()

    async def passthrough(self, request: Request, send: Send) -> None:
        body = await request.json()
        try:
            answer = await self.router.send(request.path, body, request.forwarded_headers(), None, False)
        except UpstreamError as e:
            raise HTTPError(e.status, e.message, e.code) from e
        await relay_answer(send, answer)

    async def models(self, request: Request, send: Send) -> None:
        headers = request.forwarded_headers()
        for w in self.pool.available():
            try:
                r = await asyncio.wait_for(self.router.client.request("GET", w.url, "/v1/models", headers=headers), 10)
                try:
                    data = await asyncio.wait_for(r.read(), 10)
                finally:
                    r.release()
            except (ConnectError, ResponseError, asyncio.TimeoutError):
                continue
            return await respond(send, r.status, data)
        raise HTTPError(503, "no worker is available", "no_worker")

    async def health(self, request: Request, send: Send) -> None:
        if not self.pool.available():
            raise HTTPError(503, "no worker is available", "no_worker")
        await respond(send, 200)

    async def render_metrics(self, request: Request, send: Send) -> None:
        await respond(send, 200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    async def workers(self, request: Request, send: Send) -> None:
        if request.method == "GET":
            now = time.monotonic()
            return await respond_json(send, {"policy": self.policy.name, "workers": [
                {"url": w.url, "healthy": w.healthy, "breaker": w.breaker_state(now, self.pool.breaker),
                 "in_flight": w.in_flight, "engine_queue": w.engine_queue, "served": w.served, "failed": w.failed}
                for w in self.pool.workers.values()]})
        url = request.query("url")
        if url is None:
            url = (await request.json()).get("url") if await request.body() else None
        if not isinstance(url, str) or not url.strip():
            raise HTTPError(400, "give the worker's url: {\"url\": \"http://host:port\"}", param="url")
        if request.method == "POST":
            w = self.pool.add(url)
            ok = await self.pool.probe(w)
            logger.info("worker %s added (%s)", w.url, "healthy" if ok else "not answering yet")
            return await respond_json(send, {"url": w.url, "healthy": ok})
        removed = self.pool.remove(url)
        if removed is None:
            raise HTTPError(404, f"no worker {url!r}", param="url")
        self.policy.forget(removed.url)
        logger.info("worker %s removed", removed.url)
        await respond_json(send, {"url": removed.url, "removed": True})


# ------------------------------------------------------------------------------- CLI

def build_router(a: argparse.Namespace) -> RouterApp:
    """The router the flags describe (ValueError naming the flag for bad values)."""
    if not a.worker_urls:
        logger.warning("no --worker-urls: add workers with POST /workers")
    for name in ("retry_max_retries", "max_stream_failovers", "cb_failure_threshold", "health_failure_threshold",
                 "health_success_threshold"):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 <= a.cache_threshold <= 1:
        raise ValueError("--cache-threshold must be in [0, 1]")
    health = HealthConfig(a.health_check_interval_secs, a.health_check_timeout_secs, a.health_failure_threshold,
                          max(1, a.health_success_threshold), a.health_check_endpoint)
    breaker = BreakerConfig(0 if a.disable_circuit_breaker else a.cb_failure_threshold, a.cb_timeout_duration_secs)
    retry = RetryConfig(0 if a.disable_retries else a.retry_max_retries, a.retry_initial_backoff_ms / 1000,
                        a.retry_max_backoff_ms / 1000, a.retry_backoff_multiplier, a.retry_jitter_factor,
                        a.max_stream_failovers)
    if a.policy == "cache_aware":
        policy: Policy = CacheAware(CacheAwareConfig(a.cache_threshold, a.balance_abs_threshold,
                                                     a.balance_rel_threshold, a.max_tree_size))
    else:
        policy = POLICIES[a.policy]()
    pool = WorkerPool(a.worker_urls, health, breaker)
    return RouterApp(pool, policy, retry, a.session_header, a.request_timeout_secs, a.eviction_interval_secs)


def run_router(router: RouterApp, a: argparse.Namespace) -> int:
    """Serve `router` until SIGTERM/SIGINT."""
    logger.info("routing over %d workers with %s on http://%s:%d", len(router.pool.workers), router.policy.name,
                a.host, a.port)
    server = _Server(uvicorn.Config(router.app, host=a.host, port=a.port, log_level=a.log_level, access_log=False,
                                    timeout_keep_alive=30, timeout_graceful_shutdown=10, proxy_headers=False,
                                    http="httptools"))
    server.run()
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, exiting 0 after SIGTERM/SIGINT (the first lets open streams finish for up to
    10 s, a second stops at once) instead of re-raising the signal."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.force_exit = self.should_exit
        self.should_exit = True
