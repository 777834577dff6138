"""A fake OpenAI streaming server on a loopback port with known delays: the first token `ttft` s after the
request, then one token every `tpot` s; it records when requests arrive and how many run at once."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeState:
    ttft: float = 0.2
    tpot: float = 0.05
    fail_every: int = 0  # every Nth request (1-based) answers HTTP 500
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def reset(self, **kw: Any) -> None:
        self.__init__(**kw)  # type: ignore[misc]


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            n = int(body.get("max_tokens") or 16)
            if chat:
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            for i in range(n):
                await asyncio.sleep(state.ttft if i == 0 else state.tpot)
                piece = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                yield "data: " + json.dumps({"choices": [{"index": 0, **piece, "finish_reason": None}]}) + "\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                prompt = body.get("prompt")
                plen = len(prompt) if isinstance(prompt, list) else 7
                yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": plen, "completion_tokens": n,
                                                                      "total_tokens": plen + n}}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            state.in_flight -= 1

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.arrivals.append(time.perf_counter())
        state.bodies.append(body)
        if state.fail_every and len(state.arrivals) % state.fail_every == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
                                status_code=500)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


class FakeServer:
    """uvicorn in a daemon thread; `url` is http://127.0.0.1:PORT."""

    def __init__(self) -> None:
        self.state = FakeState()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(self.state), host="127.0.0.1", port=self.port, log_level="error",
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
