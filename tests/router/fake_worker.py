"""A fake OpenAI worker with a deterministic "model": token k of a sequence depends only on the ids before it,
so a stream resumed from prompt + sent tokens continues exactly as an unbroken one (as temperature 0 does on a
real engine). It can drop connections mid-stream, answer 5xx, or be slow, to exercise the router."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

VOCAB = 1000


def next_token(ids: list[int]) -> int:
    return (sum(ids) * 31 + len(ids) * 7) % VOCAB


def generate(prompt_ids: list[int], n: int) -> list[int]:
    ids, out = list(prompt_ids), []
    for _ in range(n):
        t = next_token(ids)
        ids.append(t)
        out.append(t)
    return out


def text_of(ids: list[int]) -> str:
    return "".join(f" w{t}" for t in ids)


def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
    return [ord(c) % VOCAB for m in messages for c in f"<{m['role']}>{m.get('content') or ''}"] + [1]


def prompt_ids(body: dict[str, Any]) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], list):
        p = p[0]
    if isinstance(p, list) and p and isinstance(p[0], str):
        p = p[0]
    return [ord(c) % VOCAB for c in p] if isinstance(p, str) else list(p)


class DropConnection(Exception):
    """Raised inside a streaming body: uvicorn cuts the connection without ending the chunked body."""


@dataclass
class WorkerState:
    name: str = "w"
    tpot: float = 0.0
    die_after: int | None = None  # streams drop their connection after this many tokens
    status: int | None = None  # answer every generation with this HTTP status (e.g. 500, 503)
    error_event_after: int | None = None  # streams send an engine_dead error event after this many tokens
    healthy: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)
    queue: int = 0
    streams_cut: int = 0  # streams that did not reach their end (dropped, or their client went away)


def make_app(state: WorkerState) -> Starlette:
    async def generate_route(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        state.requests.append({"path": request.url.path, **body})
        if state.status is not None:
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
                                state.status)
        pids = chat_prompt(body["messages"]) if chat else prompt_ids(body)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        n = int(limit) if limit is not None else (16 if not chat else 40)
        out = generate(pids, n)
        ids_wanted = body.get("return_token_ids")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{state.name}-{len(state.requests)}"
        if not body.get("stream"):
            if chat:
                return JSONResponse({"id": rid, "object": "chat.completion", "model": "fake", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text_of(out)}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": len(pids), "completion_tokens": n, "total_tokens": len(pids) + n},
                    "worker": state.name})
            return JSONResponse({"id": rid, "object": "text_completion", "model": "fake", "choices": [
                {"index": 0, "text": text_of(out), "finish_reason": "length"}], "worker": state.name,
                "usage": {"prompt_tokens": len(pids), "completion_tokens": n, "total_tokens": len(pids) + n}})

        async def events() -> AsyncIterator[str]:
            ended = False
            try:
                async for event in body_events():
                    yield event
                ended = True
            finally:
                if not ended:
                    state.streams_cut += 1

        async def body_events() -> AsyncIterator[str]:
            base = {"id": rid, "created": 1, "model": "fake",
                    "object": "chat.completion.chunk" if chat else "text_completion"}
            if chat:
                first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                if ids_wanted:
                    first["prompt_token_ids"] = pids
                yield "data: " + json.dumps(first) + "\n\n"
            for i, t in enumerate(out):
                if state.die_after is not None and i >= state.die_after:
                    raise DropConnection()
                if state.error_event_after is not None and i >= state.error_event_after:
                    yield "data: " + json.dumps({"error": {"message": "the engine is not running", "type":
                                                           "server_error", "param": None, "code": "engine_dead"}}) + "\n\n"
                    return
                await asyncio.sleep(state.tpot)
                fin = "length" if i == n - 1 else None
                choice: dict[str, Any] = {"index": 0, "finish_reason": fin}
                choice.update({"delta": {"content": text_of([t])}} if chat else {"text": text_of([t])})
                if ids_wanted:
                    choice["token_ids"] = [t]
                    if i == 0 and not chat:
                        choice["prompt_token_ids"] = pids
                yield "data: " + json.dumps({**base, "choices": [choice]}) + "\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({**base, "choices": [], "usage": {
                    "prompt_tokens": len(pids), "completion_tokens": n, "total_tokens": len(pids) + n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(status_code=200 if state.healthy else 503)

    async def metrics(request: Request) -> Response:
        return Response(f"rivulet:num_requests_running{{model_name=\"fake\"}} {state.queue}\n"
                        "rivulet:num_requests_waiting{model_name=\"fake\"} 0\n")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": state.name}]})

    return Starlette(routes=[Route("/v1/completions", generate_route, methods=["POST"]),
                             Route("/v1/chat/completions", generate_route, methods=["POST"]),
                             Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """An ASGI app under uvicorn in a daemon thread; `url` is http://127.0.0.1:PORT."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                    access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class FakeWorker(ThreadServer):
    def __init__(self, name: str, **kw: Any) -> None:
        self.state = WorkerState(name=name, **kw)
        super().__init__(make_app(self.state))
