"""Two real ``rivulet serve`` replicas behind the router; one is SIGKILLed under load. Every request (streamed
or not) completes exactly once with the text a healthy replica gives at temperature 0."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any, Iterator

import httpx
import pytest

from fake_worker import ThreadServer
from rivulet.router.app import build_router
from server.server_helpers import ServerProcess
from test_router_proxy import router_args

N, MAX_TOKENS = 64, 16


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    procs: list[ServerProcess] = []
    try:
        for _ in range(2):
            procs.append(ServerProcess("--max-model-len", "256", "--max-num-seqs", "64"))
        yield procs
    finally:
        for p in procs:
            p.stop()


def body(i: int, stream: bool) -> dict[str, Any]:
    return {"prompt": f"Request {i}: the list of numbers from {i} to {i + 20} is", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def run_one(client: httpx.AsyncClient, url: str, i: int, chunks_seen: list[int]) -> str:
    stream = (i // 2) % 2 == 0  # S S N N ...: round robin in arrival order gives each replica both kinds
    if not stream:
        r = await client.post(url, json=body(i, False))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text, done = "", 0
    async with client.stream("POST", url, json=body(i, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            text += obj["choices"][0]["text"]
            chunks_seen[0] += 1
    assert done == 1
    return text


async def reference(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        answers = await asyncio.gather(*(client.post(url, json=body(i, False)) for i in range(N)))
    return [r.json()["choices"][0]["text"] for r in answers]


def test_replica_killed_under_load(replicas: list[ServerProcess]) -> None:
    a, b = replicas
    router = build_router(router_args("--worker-urls", a.url, b.url, "--policy", "round_robin",
                                      "--health-check-interval-secs", "0.5", "--retry-initial-backoff-ms", "10"))
    server = ThreadServer(router.app)

    async def load() -> list[str]:
        chunks_seen = [0]
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(run_one(client, server.url + "/v1/completions", i, chunks_seen))
                     for i in range(N)]
            while chunks_seen[0] < N // 2:  # streams are under way on both replicas
                await asyncio.sleep(0.01)
            a.proc.send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

    try:
        texts = asyncio.run(asyncio.wait_for(load(), 300))
        want = asyncio.run(reference(b.url + "/v1/completions"))  # the survivor, asked directly
        assert texts == want
        served = {w.url: w.served for w in router.pool.workers.values()}
        assert served[b.url] >= N // 2 and not router.pool.workers[a.url].healthy
        metrics = httpx.get(server.url + "/metrics").text
        assert 'rivulet:router_stream_failovers_total{outcome="resumed"}' in metrics
    finally:
        server.stop()
