"""Killing the engine process mid-stream: the client gets an error event within seconds, /health
turns 503, new requests get a 500 error body, and the API server itself keeps answering."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Iterator

import httpx
import openai
import pytest

from server_helpers import ServerProcess, assert_error_body, wait_until


@pytest.fixture(scope="module")
def doomed() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-model-len", "512")
    try:
        yield proc
    finally:
        proc.stop()


def test_engine_death_mid_stream(doomed: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    chunks: list[dict] = []
    killed_at = None
    with httpx.Client(base_url=doomed.url, timeout=30) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            assert line != "data: [DONE]", "the stream must not end normally"
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 3:
                os.kill(doomed.engine_pid(), signal.SIGKILL)
                killed_at = time.monotonic()
    # the front end polls the engine process every 0.1 s; 2 s leaves room for two loaded cores
    assert killed_at is not None and time.monotonic() - killed_at < 2
    err = chunks[-1]["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_dead" and err["message"]
    assert all("error" not in c for c in chunks[:-1])

    assert wait_until(lambda: httpx.get(f"{doomed.url}/health").status_code == 503, timeout=5)
    assert_error_body(httpx.get(f"{doomed.url}/health"), 503)
    r = httpx.post(f"{doomed.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert assert_error_body(r, 500)["code"] == "engine_dead"
    client = openai.OpenAI(base_url=doomed.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert [m.id for m in client.models.list().data] == ["default"]  # the API server itself still answers
    assert httpx.get(f"{doomed.url}/metrics").status_code == 200
    assert doomed.stop() == 0
