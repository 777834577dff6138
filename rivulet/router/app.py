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
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rivulet.router.metrics import RouterMetrics
from rivulet.router.policies import POLICIES, CacheAware, CacheAwareConfig, Policy, RouteInput
from rivulet.router.proxy import RetryConfig, Router, UpstreamError, forwarded_headers
from rivulet.router.workers import BreakerConfig, HealthConfig, WorkerPool

logger = logging.getLogger("rivulet.router")

GENERATE = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


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


class RouterApp:
    """The router's state and its HTTP handlers."""

    def __init__(self, pool: WorkerPool, policy: Policy, retry: RetryConfig, session_header: str = "x-session-id",
                 read_timeout: float = 1800.0, maintain_interval: float = 60.0) -> None:
        self.pool, self.policy = pool, policy
        self.metrics = RouterMetrics()
        self.metrics.watch(lambda: self.pool)
        self.router = Router(pool, policy, retry, self.metrics, read_timeout)
        self.session_header = session_header.lower()
        self.maintain_interval = maintain_interval
        self.app = Starlette(routes=[
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.passthrough, methods=["POST"]),
            Route("/detokenize", self.passthrough, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.render_metrics, methods=["GET"]),
            Route("/workers", self.workers, methods=["GET", "POST", "DELETE"]),
        ], lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.pool.start()
        task = asyncio.create_task(self._maintain())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.pool.close()
            await self.router.close()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.maintain_interval)
            self.policy.maintain()

    async def _json(self, request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"the body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        return body

    async def generate(self, request: Request) -> Response:
        start = time.perf_counter()
        kind = GENERATE[request.url.path]
        body = await self._json(request)
        if isinstance(body, JSONResponse):
            return body
        route = route_input(kind, body, request.headers.get(self.session_header))
        headers = forwarded_headers(request.headers)
        stream = bool(body.get("stream"))
        worker_body = {**body, "return_token_ids": True} if stream else body
        try:
            answer = await self.router.send(request.url.path, worker_body, headers, route, stream)
        except UpstreamError as e:
            self.metrics.requests.labels("none", str(e.status)).inc()
            return error(e.status, e.message, e.code)
        self.metrics.decisions.labels(self.policy.name, self.policy.last_reason).inc()
        self.metrics.first_byte.observe(time.perf_counter() - start)
        self.metrics.requests.labels(answer.worker.url, str(answer.status)).inc()
        if answer.stream is None:
            return Response(answer.body, answer.status, headers=answer.headers)
        events = self.router.relay(kind, request.url.path, body, worker_body, headers, answer)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def passthrough(self, request: Request) -> Response:
        body = await self._json(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            answer = await self.router.send(request.url.path, body, forwarded_headers(request.headers), None, False)
        except UpstreamError as e:
            return error(e.status, e.message, e.code)
        return Response(answer.body, answer.status, headers=answer.headers)

    async def models(self, request: Request) -> Response:
        headers = forwarded_headers(request.headers)
        for w in self.pool.available():
            with contextlib.suppress(Exception):
                async with self.router.client.get(w.url + "/v1/models", headers=headers,
                                                  timeout=aiohttp.ClientTimeout(total=10)) as r:
                    return Response(await r.read(), r.status, media_type="application/json")
        return error(503, "no worker is available", "no_worker")

    async def health(self, request: Request) -> Response:
        if self.pool.available():
            return Response(status_code=200)
        return error(503, "no worker is available", "no_worker")

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def workers(self, request: Request) -> Response:
        if request.method == "GET":
            now = time.monotonic()
            return JSONResponse({"policy": self.policy.name, "workers": [
                {"url": w.url, "healthy": w.healthy, "breaker": w.breaker_state(now, self.pool.breaker),
                 "in_flight": w.in_flight, "engine_queue": w.engine_queue, "served": w.served, "failed": w.failed}
                for w in self.pool.workers.values()]})
        url = request.query_params.get("url")
        if url is None:
            body = await self._json(request) if await request.body() else {}
            if isinstance(body, JSONResponse):
                return body
            url = body.get("url")
        if not isinstance(url, str) or not url.strip():
            return error(400, "give the worker's url: {\"url\": \"http://host:port\"}", param="url")
        if request.method == "POST":
            w = self.pool.add(url)
            ok = await self.pool.probe(w)
            logger.info("worker %s added (%s)", w.url, "healthy" if ok else "not answering yet")
            return JSONResponse({"url": w.url, "healthy": ok}, 200)
        removed = self.pool.remove(url)
        if removed is None:
            return error(404, f"no worker {url!r}", param="url")
        self.policy.forget(removed.url)
        logger.info("worker %s removed", removed.url)
        return JSONResponse({"url": removed.url, "removed": True})


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
                                    timeout_keep_alive=30, timeout_graceful_shutdown=10))
    server.run()
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, exiting 0 after SIGTERM/SIGINT (the first lets open streams finish for up to
    10 s, a second stops at once) instead of re-raising the signal."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.force_exit = self.should_exit
        self.should_exit = True
