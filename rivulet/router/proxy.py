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

from rivulet.router.failover import (StreamState, resumable, server_error_event, sse, strip_token_ids,
                                     strip_token_ids_raw)
from rivulet.router.metrics import RouterMetrics
from rivulet.router.policies import Policy, RouteInput
from rivulet.router.upstream import ConnectError, Response, ResponseError, Upstream
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
    stream: Response | None = None


class Router:
    def __init__(self, pool: WorkerPool, policy: Policy, retry: RetryConfig, metrics: RouterMetrics,
                 read_timeout: float = 1800.0) -> None:
        self.pool, self.policy, self.retry, self.metrics = pool, policy, retry, metrics
        self.rng = random.Random()
        self.read_timeout = read_timeout
        # keep-alive connections per worker; idle ones are dropped before a worker's own keep-alive
        # timeout (uvicorn: 5 s) closes them
        self.client = Upstream(connect_timeout=5.0, read_timeout=read_timeout, idle_timeout=2.0)

    async def close(self) -> None:
        await self.client.close()

    # ---- one attempt after another ----

    async def send(self, path: str, body: dict[str, Any] | bytes, headers: dict[str, str], route: RouteInput | None,
                   stream: bool, tried: set[str] | None = None) -> Answer:
        """The first usable answer to `body` (a JSON object, or its bytes) from some worker (streaming: headers
        read, body open). `route` None: any worker (no policy). A 4xx answer is usable; so is the last 5xx
        once retries are spent. Raises UpstreamError when no worker answered at all."""
        tried = set() if tried is None else tried
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        last: Answer | None = None
        for attempt in range(self.retry.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.retry.backoff(attempt - 1, self.rng))
            workers = self.pool.available(tried) or self.pool.available()
            if not workers:
                continue
            w = self.policy.choose(workers, route) if route is not None else self.rng.choice(workers)
            answer = await self._attempt(w, path, data, headers, stream)
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

    async def _attempt(self, w: Worker, path: str, data: bytes, headers: dict[str, str],
                       stream: bool) -> Answer | None:
        """One try on `w`; None when the connection failed (the worker is marked)."""
        w.in_flight += 1
        keep_open = False
        try:
            resp = await self.client.request("POST", w.url, path, data, headers)
            try:
                if not (stream and resp.status == 200):
                    content = await resp.read()
                    if resp.status < 500:
                        self.pool.succeeded(w)
                    return Answer(w, resp.status, _passed_headers(resp), content)
                keep_open = True
                return Answer(w, resp.status, _passed_headers(resp), stream=resp)
            finally:
                if not keep_open:
                    resp.release()
        except ConnectError as e:  # nobody listening: out until probes pass
            self.pool.connection_lost(w, str(e))
            return None
        except ResponseError as e:  # dropped mid-answer, or no byte within the read timeout
            self.pool.failed(w, str(e))
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
                w, failure, complete = answer.worker, None, False
                try:
                    async for events in _event_batches(answer.stream):
                        out: list[bytes] = []  # what this network read gives the client, sent at once
                        for data in events:
                            if data is DONE:  # the body was read to its end
                                complete = True
                                break
                            obj = _parse(data) if resumed_from is not None or state.needs_parse(data) else None
                            if obj is not None and server_error_event(obj):
                                failure = "error event: " + str(obj["error"].get("message"))[:200]
                                break
                            if resumed_from is None:  # the hot path: bytes in, bytes out, most events unparsed
                                state.observe(obj) if obj is not None else state.observe_raw(data)
                                out.append(b"data: " + (data if wants_ids else strip_token_ids_raw(data)) + b"\n\n")
                            else:
                                new = state.rewrite(obj, resumed_from)
                                if new is not None:
                                    state.observe(new)
                                    out.append(sse(new if wants_ids else strip_token_ids(new)))
                        if out:
                            yield b"".join(out)
                        if complete or failure is not None:
                            break
                    else:
                        failure = "the stream ended without [DONE]"
                except ResponseError as e:
                    failure = str(e)
                finally:  # a finished answer's connection goes back to the pool; any other is closed (the worker aborts)
                    answer.stream.release() if complete else answer.stream.close()
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
            if answer is not None and answer.stream is not None and not answer.stream.closed:
                answer.stream.close()
                answer.worker.in_flight -= 1


DONE = b"[DONE]"


async def _event_batches(resp: Response) -> AsyncIterator[list[bytes]]:
    """The data of the SSE events of `resp`, in lists of those each network read completes; `DONE` (the
    object) comes after the body is read to its end, so the connection goes back to the pool instead of
    being closed."""
    buf, done = b"", False
    async for piece in resp:
        if done:
            continue
        buf += piece
        events: list[bytes] = []
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            raw, buf = buf[:end], buf[end + 2:]
            data = raw[5:].lstrip() if raw.startswith(b"data:") and b"\n" not in raw else \
                b"".join(line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:"))
            if not data:
                continue
            if data == DONE:
                done = True
                break
            events.append(data)
        if events:
            yield events
    if done:
        yield [DONE]


def _parse(data: bytes) -> Any:
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return {"error": {"message": "a worker sent an event that is not JSON", "type": "server_error"}}


def _error_event(message: str) -> bytes:
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": "worker_failed"}}) + \
        b"data: [DONE]\n\n"


def _passed_headers(resp: Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k in ("content-type", "retry-after", "x-request-id")}
