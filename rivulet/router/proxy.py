"""Sending one request to the workers: choose, retry before the first byte, resume after it.

Before the first byte reaches the client, any failure is retried on another worker (backoff with
jitter): a refused or dropped connection, a timeout, a 5xx answer, or a non-streamed answer cut
short. A 4xx is the request's own fault and goes back as is. After the first byte, a stream whose
worker fails is resumed on another worker (`failover.py`) and the client sees one stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx

from rivulet.router.failover import StreamState, resumable, server_error_event, sse, strip_token_ids
from rivulet.router.metrics import RouterMetrics
from rivulet.router.policies import Policy, RouteInput
from rivulet.router.workers import Worker, WorkerPool

logger = logging.getLogger("rivulet.router")

FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")


@dataclass
class RetryConfig:
    max_retries: int = 3  # 0: no retries
    initial_backoff: float = 0.05
    max_backoff: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2  # +- this fraction of each backoff
    max_failovers: int = 3  # resumes of one stream

    def backoff(self, attempt: int, rng: random.Random) -> float:
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** attempt)
        return base * (1 + self.jitter * (2 * rng.random() - 1))


class UpstreamError(Exception):
    """No worker could answer: the router's own 502/503 (``status``) with an OpenAI error body."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class Answer:
    """A worker's answer: its status, headers and body, or (streaming) the open response."""

    worker: Worker
    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: httpx.Response | None = None


class Router:
    def __init__(self, pool: WorkerPool, policy: Policy, retry: RetryConfig, metrics: RouterMetrics,
                 read_timeout: float = 1800.0) -> None:
        self.pool, self.policy, self.retry, self.metrics = pool, policy, retry, metrics
        self.rng = random.Random()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def close(self) -> None:
        await self.client.aclose()

    # ---- one attempt after another ----

    async def send(self, path: str, body: dict[str, Any], headers: dict[str, str], route: RouteInput | None,
                   stream: bool, tried: set[str] | None = None) -> Answer:
        """The first usable answer to `body` from some worker (streaming: headers read, body open).
        `route` None: any worker (no policy). A 4xx answer is usable; so is the last 5xx once retries
        are spent. Raises UpstreamError when no worker answered at all."""
        tried = set() if tried is None else tried
        last: Answer | None = None
        for attempt in range(self.retry.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.retry.backoff(attempt - 1, self.rng))
            workers = self.pool.available(tried) or self.pool.available()
            if not workers:
                continue
            w = self.policy.choose(workers, route) if route is not None else self.rng.choice(workers)
            answer = await self._attempt(w, path, body, headers, stream)
            if answer is None:
                tried.add(w.url)
                self.metrics.retry("connection")
                continue
            if answer.status >= 500 or answer.status == 429:
                tried.add(w.url)
                if answer.status != 503 and answer.status != 429:  # 503/429 say "busy", not "broken"
                    self.pool.failed(w, f"HTTP {answer.status}")
                self.metrics.retry(f"http_{answer.status}")
                last = answer
                continue
            if route is not None:
                self.policy.routed(w, route)
            return answer
        if last is not None:
            return last
        raise UpstreamError(503, "no worker could take the request (all unavailable or failing)", "no_worker")

    async def _attempt(self, w: Worker, path: str, body: dict[str, Any], headers: dict[str, str],
                       stream: bool) -> Answer | None:
        """One try on `w`; None when the connection failed (the worker is marked)."""
        w.in_flight += 1
        keep_open = False
        try:
            req = self.client.build_request("POST", w.url + path, json=body, headers=headers)
            resp = await self.client.send(req, stream=True)
            try:
                ok_stream = stream and resp.status_code == 200
                if not ok_stream:
                    data = await resp.aread()
                    if resp.status_code < 500:
                        self.pool.succeeded(w)
                    return Answer(w, resp.status_code, _passed_headers(resp), data)
                keep_open = True
                return Answer(w, resp.status_code, _passed_headers(resp), stream=resp)
            finally:
                if not keep_open:
                    await resp.aclose()
        except httpx.HTTPError as e:
            self.pool.connection_lost(w, type(e).__name__)
            return None
        finally:
            if not keep_open:
                w.in_flight -= 1

    # ---- streams ----

    async def relay(self, kind: str, path: str, body: dict[str, Any], worker_body: dict[str, Any],
                    headers: dict[str, str], first: Answer) -> AsyncIterator[bytes]:
        """The client's SSE stream: `first`'s events (token-id fields removed unless the client asked for
        them), resumed on other workers when its worker fails. Ends with ``[DONE]`` or an error event.
        `body` is the client's request, `worker_body` what the workers were sent (with return_token_ids)."""
        wants_ids = bool(body.get("return_token_ids"))
        why_not = resumable(kind, body)
        state = StreamState(kind, body)
        answer: Answer | None = first
        resumed_from: int | None = None  # tokens sent before the current continuation; None: the original
        tried: set[str] = set()
        try:
            while answer is not None:
                assert answer.stream is not None
                w, failure = answer.worker, None
                try:
                    async for obj, raw in _events(answer.stream):
                        if obj == "[DONE]":
                            break
                        if server_error_event(obj):
                            failure = "error event: " + str(obj["error"].get("message"))[:200]
                            break
                        if resumed_from is None:
                            state.observe(obj)
                            yield raw if wants_ids or "error" in obj else sse(strip_token_ids(obj))
                        else:
                            new = state.rewrite(obj, resumed_from)
                            if new is not None:
                                state.observe(new)
                                yield sse(new if wants_ids else strip_token_ids(new))
                    else:
                        failure = "the stream ended without [DONE]"
                except httpx.HTTPError as e:
                    failure = f"{type(e).__name__}: {e}"
                finally:
                    await answer.stream.aclose()
                    w.in_flight -= 1
                answer = None
                if failure is None:
                    self.pool.succeeded(w)
                    yield b"data: [DONE]\n\n"
                    return
                self.pool.failed(w, failure)
                tried.add(w.url)
                logger.warning("stream %s from %s failed after %d tokens: %s", state.id, w.url,
                               len(state.token_ids), failure)
                if state.finished:  # only the usage chunk or [DONE] was lost
                    yield b"data: [DONE]\n\n"
                    return
                if state.id is None and state.resumes < self.retry.max_failovers:  # nothing sent yet: start over
                    state.resumes += 1
                    try:
                        answer = await self.send(path, worker_body, headers, None, True, tried)
                    except UpstreamError as e:
                        yield _error_event(f"the worker serving this stream failed and no other answered: {e}")
                        return
                    if answer.status != 200:
                        yield _error_event(f"the worker serving this stream failed; a retry answered HTTP "
                                           f"{answer.status}: {answer.body[:300].decode(errors='replace')}")
                        return
                    continue
                reason = why_not or ("the worker returned no token ids" if state.prompt_ids is None else None)
                if reason is None and state.resumes >= self.retry.max_failovers:
                    reason = f"{state.resumes} resumes already"
                if reason is not None:
                    self.metrics.failover("failed")
                    yield _error_event(f"the worker serving this stream failed ({failure}); it cannot be resumed "
                                       f"on another worker: {reason}")
                    return
                state.resumes += 1
                resumed_from = len(state.token_ids)
                try:
                    answer = await self.send("/v1/completions", state.continuation(), headers, None, True, tried)
                except UpstreamError as e:
                    answer = None
                    self.metrics.failover("failed")
                    yield _error_event(f"the worker serving this stream failed and no other could resume it: {e}")
                    return
                if answer.status != 200:
                    self.metrics.failover("failed")
                    yield _error_event(f"resuming the stream failed: HTTP {answer.status}: "
                                       f"{answer.body[:300].decode(errors='replace')}")
                    return
                self.metrics.failover("resumed")
                logger.info("stream %s resumed on %s after %d tokens", state.id, answer.worker.url, resumed_from)
        finally:
            if answer is not None and answer.stream is not None and not answer.stream.is_closed:
                await answer.stream.aclose()
                answer.worker.in_flight -= 1


async def _events(resp: httpx.Response) -> AsyncIterator[tuple[Any, bytes]]:
    """(parsed data, raw event bytes) for each SSE event of `resp`, as it arrives."""
    buf = b""
    async for piece in resp.aiter_bytes():
        buf += piece
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            raw, buf = buf[:end + 2], buf[end + 2:]
            data = b"".join(line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:"))
            if not data:
                continue
            if data == b"[DONE]":
                yield "[DONE]", raw
                return
            try:
                yield json.loads(data), raw
            except json.JSONDecodeError:
                yield {"error": {"message": "a worker sent an event that is not JSON", "type": "server_error"}}, raw


def _error_event(message: str) -> bytes:
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": "worker_failed"}}) + \
        b"data: [DONE]\n\n"


def _passed_headers(resp: httpx.Response) -> dict[str, str]:
    keep = ("content-type", "retry-after", "x-request-id")
    return {k: v for k, v in resp.headers.items() if k.lower() in keep}


def forwarded_headers(headers: Any) -> dict[str, str]:
    """The client headers a worker should see."""
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}

