"""The gate in front of every route of the OpenAI server (ASGI middleware): 503 while draining, 401 without
the API key, 413 for a body over ``--max-request-bytes``, and the count of HTTP requests in flight."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rivulet.entrypoints.openai.errors import OpenAIError, error_response
from rivulet.entrypoints.openai.serving_base import ServerContext

# Paths that stay open without the API key (as in vLLM: probes, scrapes, docs).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})


class Gate:
    """ASGI middleware in front of every route: 503 while draining, 401 without the API key, 413 for a
    body over ``--max-request-bytes`` (by its Content-Length, or counted as it arrives), and the count
    of HTTP requests in flight (a streamed answer counts until its last byte)."""

    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx
        key = ctx.settings.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value.strip(), self._expected or b"")
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = self.ctx
        if ctx.draining:
            ctx.metrics.reject("draining")
            err = OpenAIError(503, "the server is shutting down", code="server_shutting_down",
                              headers={"Retry-After": str(ctx.settings.retry_after_s), "Connection": "close"})
            await error_response(err)(scope, receive, send)
            return
        if self._expected is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            err = OpenAIError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error_response(err)(scope, receive, send)
            return
        limit = ctx.settings.max_request_bytes
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        too_large = length is not None and (not length.isdigit() or int(length) > limit)
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            replay = await _read_limited(receive, limit)  # a chunked body: counted as it arrives
            too_large = replay is None
            receive = replay or receive
        if too_large:
            ctx.metrics.reject("too_large")
            err = OpenAIError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)",
                              code="request_too_large", headers={"Connection": "close"})
            await error_response(err)(scope, receive, send)
            return
        ctx.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            ctx.inflight -= 1


async def _read_limited(receive: Receive, limit: int) -> Receive | None:
    """A body without Content-Length, read up to `limit` bytes: a `receive` that replays it, or None when it
    is larger (or the client left)."""
    parts, seen, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        seen += len(parts[-1])
        if seen > limit:
            return None
        more = message.get("more_body", False)
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": b"".join(parts), "more_body": False}
        return await receive()
    return replay
