"""Streaming answers: per-choice deltas, server-sent events, and the SSE response that watches its client."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rivulet.config import RivuletError
from rivulet.engine.outputs import CompletionOutput, PositionLogprobs
from rivulet.entrypoints.openai.aio import Deadline, close_quietly, wait_for_disconnect
from rivulet.entrypoints.openai.engine_client import EngineDeadError
from rivulet.entrypoints.openai.errors import OpenAIError, dumps, engine_dead_error, error_body

logger = logging.getLogger("rivulet.server")


@dataclass
class Delta:
    """What one choice gained since the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class ChoiceState:
    """How much of one choice was already sent."""

    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False
    chars_emitted: int = 0  # text offset for streamed completions logprobs

    def delta(self, c: CompletionOutput) -> Delta | None:
        """The unsent part of ``c`` (None when nothing is new); marks it sent."""
        if self.finished:
            return None
        text, tokens = c.text[self.text_sent:], c.token_ids[self.tokens_sent:]
        lps = c.logprobs[self.tokens_sent:len(c.token_ids)] if c.logprobs is not None else None
        if not text and not tokens and c.finish_reason is None:
            return None
        self.text_sent, self.tokens_sent = len(c.text), len(c.token_ids)
        self.finished = c.finish_reason is not None
        return Delta(text, tokens, lps, c.finish_reason, c.stop_reason)


@dataclass
class Usage:
    """Token counts of a response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error_event(e: BaseException) -> str:
    """The event that ends a stream which failed after it started."""
    if isinstance(e, EngineDeadError):
        return sse(engine_dead_error(e).body())
    if isinstance(e, OpenAIError):
        return sse(e.body())
    if isinstance(e, RivuletError):
        return sse(error_body(400, str(e)))
    return sse(error_body(500, f"internal server error: {type(e).__name__}: {e}"))


class EventStreamResponse(Response):
    """An SSE response that sends ``events`` while watching for the client to leave.

    When the events end, the client disconnects, the deadline passes (the stream then ends with its
    408 as an error event), or this task is cancelled, ``on_close`` runs (it aborts unfinished engine
    requests and frees their slots) - whether or not streaming started.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None, deadline: Deadline | None = None) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self.events = events
        self.on_close = on_close
        self.deadline = deadline
        self.started = False
        self.sse_headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                        "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send_all(send))
        watch = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({sending, watch}, return_when=asyncio.FIRST_COMPLETED,
                                         timeout=None if self.deadline is None else self.deadline.left())
        finally:
            sending.cancel()
            watch.cancel()
            await asyncio.gather(sending, watch, return_exceptions=True)
            await close_quietly(self.events)
            await self.on_close()
        if not done and self.deadline is not None:  # out of time: end the stream with the 408 (a stalled client
            await self._end_with(send, sse(self.deadline.error().body()))  # cannot hold this task: 1 s to take it)
            return
        if not sending.cancelled() and sending.exception() is not None:
            raise sending.exception()  # type: ignore[misc]

    async def _start(self, send: Send) -> None:
        self.started = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.sse_headers.items()]})

    async def _send_all(self, send: Send) -> None:
        await self._start(send)
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _end_with(self, send: Send, event: str) -> None:
        async def end() -> None:
            if not self.started:
                await self._start(send)
            await send({"type": "http.response.body", "body": (event + SSE_DONE).encode(), "more_body": False})
        try:
            await asyncio.wait_for(end(), 1.0)
        except (asyncio.TimeoutError, OSError):
            logger.info("a timed-out stream's client did not take its last event")
