"""OpenAI error bodies, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

Handlers raise ``OpenAIError`` (or let a ``RivuletError`` / ``EngineDeadError`` escape);
``install_exception_handlers`` turns those, FastAPI's 422 validation errors (answered as 400, as
OpenAI does), Starlette's HTTP errors (404 route, 405 method) and anything unexpected (500) into
that body.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from rivulet.config import RivuletError
from rivulet.engine.async_llm import EngineDeadError

logger = logging.getLogger("rivulet.server")

# OpenAI's error "type" per HTTP status.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class OpenAIError(Exception):
    """An error to answer with an OpenAI error body and the given HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` with OpenAI's type for ``status``."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def dumps(obj: Any) -> str:
    """JSON text for a response body or an SSE event.

    ``ensure_ascii`` keeps the output valid UTF-8 whatever strings it carries (a lone surrogate
    is written as an escape instead of failing the encoding).
    """
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


class JSONBody(Response):
    """A JSON response encoded with ``dumps``."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("ascii")


def error_response(err: OpenAIError) -> JSONBody:
    """The HTTP response for ``err``."""
    return JSONBody(err.body(), status_code=err.status, headers=err.headers)


def from_rivulet_error(e: RivuletError, param: str | None = None) -> OpenAIError:
    """400 for invalid input; a prompt over the context gets OpenAI's ``context_length_exceeded`` code."""
    message = str(e)
    code = "context_length_exceeded" if "maximum context length" in message else None
    return OpenAIError(400, message, param=param, code=code)


def engine_dead_error(e: BaseException) -> OpenAIError:
    """500: the engine process is gone, so no request can complete."""
    return OpenAIError(500, f"the engine is not running: {e}", code="engine_dead")


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the first offending field."""
    parts: list[str] = []
    param: str | None = None
    for err in errors[:5]:
        if err.get("type") == "json_invalid":  # FastAPI's loc is (body, character offset): not a field
            ctx = err.get("ctx") or {}
            return f"the request body is not valid JSON ({ctx.get('error', 'decode error')} at character " \
                   f"{err.get('loc', ('', '?'))[-1]})", None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else str(err.get("msg", "invalid")))
    if len(errors) > 5:
        parts.append(f"and {len(errors) - 5} more")
    return "; ".join(parts) or "invalid request", param


def install_exception_handlers(app: FastAPI) -> None:
    """Answer every error the app can raise with an OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RivuletError)
    async def _rivulet_error(_: Request, exc: RivuletError) -> Response:
        return error_response(from_rivulet_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(list(exc.errors()))
        return error_response(OpenAIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail, default=str)
        code = "not_found" if exc.status_code == 404 else None
        return error_response(OpenAIError(exc.status_code, message, code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(engine_dead_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unexpected error while serving a request")
        return error_response(OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}"))
