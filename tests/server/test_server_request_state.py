"""Nothing of a request outlives it in the API server: a mixed load over real HTTP (streamed and not, n > 1,
logprobs, stop strings, streams the client closes early, requests it gives up on, refused requests, preemption
under a small KV cache), then nothing the app keeps alive is a request's state or names one, nothing grew with
the number of requests, no task is left behind, and the engine reports itself empty. The app runs in this
process (uvicorn on a loopback socket) so that its object graph can be walked; the engine runs in its own
process as in `rivulet serve`."""

from __future__ import annotations

import asyncio
import random

import httpx
import uvicorn

from helpers import reachable
from rivulet.engine.args import EngineArgs
from rivulet.engine.async_llm import AsyncLLM
from rivulet.engine.outputs import RequestOutput
from rivulet.entrypoints.openai.api_server import build_app
from rivulet.entrypoints.openai.launch import ServerSettings, bind_socket
from rivulet.entrypoints.openai.metrics import RequestTracker
from rivulet.entrypoints.openai.serving_base import RequestGroup

WORDS = "the river ran past stone bridges and silver gardens under a winter morning light".split()
PER_REQUEST = (RequestOutput, RequestGroup, RequestTracker, asyncio.Queue)


def _body(rng: random.Random) -> tuple[str, dict]:
    body: dict = {"model": "smol", "max_tokens": rng.randint(1, 16), "temperature": rng.choice([0.0, 0.8])}
    roll = rng.random()
    if roll < 0.1:
        body["n"] = 2
    elif roll < 0.2:
        body["stop"] = [" the", "e"]
    elif roll < 0.25:
        body["max_tokens"] = 10_000  # more than the context: refused with a 400
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
    if rng.random() < 0.5:
        if rng.random() < 0.2:
            body["logprobs"] = 2
        return "/v1/completions", {**body, "prompt": text}
    if rng.random() < 0.2:
        body.update(logprobs=True, top_logprobs=2)
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


async def _one(client: httpx.AsyncClient, rng: random.Random, counts: dict[str, int]) -> None:
    path, body = _body(rng)
    roll = rng.random()
    if roll < 0.5:
        body["stream"] = True
        async with client.stream("POST", path, json=body) as resp:
            async for line in resp.aiter_lines():
                if roll < 0.05 and line.startswith("data:"):
                    counts["closed early"] += 1
                    return  # the client hangs up mid-stream: the server aborts the request
        counts[str(resp.status_code)] += 1
        return
    try:  # some clients give up before the answer: the server sees the disconnect and aborts
        resp = await client.post(path, json=body, timeout=0.05 if roll > 0.95 else 120)
        counts[str(resp.status_code)] += 1
    except httpx.TimeoutException:
        counts["gave up"] += 1


async def _load(client: httpx.AsyncClient, rng: random.Random, count: int, concurrency: int = 12) -> dict[str, int]:
    counts: dict[str, int] = {k: 0 for k in ("200", "400", "closed early", "gave up")}
    todo = iter(range(count))

    async def worker() -> None:
        for _ in todo:
            await _one(client, rng, counts)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


async def _settle(app, engine: AsyncLLM, timeout: float = 60.0) -> None:
    """Wait until every HTTP request is answered and the engine has nothing left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while app.state.ctx.inflight or engine.num_unfinished_requests:
        assert loop.time() < deadline, "the server did not become idle"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the aborts of closed requests reach the engine


async def _scenario() -> None:
    config = EngineArgs(dtype="float32", max_num_seqs=16, max_model_len=256, num_kv_blocks=40,
                        max_num_batched_tokens=128).create_engine_config()
    engine = await AsyncLLM.start(config)
    app = build_app(engine, ServerSettings(served_model_names=["smol"], max_num_seqs=16))
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        rng = random.Random(0)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await _load(client, rng, 30)
            await _settle(app, engine)
            tasks_before = len(asyncio.all_tasks())
            before = reachable.census(app)
            counts = await _load(client, rng, 150)
            await _settle(app, engine)
            assert counts["400"] > 0 and counts["closed early"] > 0 and counts["gave up"] > 0, counts
            assert counts["200"] > 100, counts

            held = reachable.find(app, lambda o: isinstance(o, PER_REQUEST) or (
                isinstance(o, str) and o.startswith(("cmpl-", "chatcmpl-"))))
            assert not held, "finished requests still reachable from the app:\n" + "\n".join(held)
            after = reachable.census(app)
            grown = {k: (before[k], after[k]) for k in after if after[k] > before[k]}
            assert not grown, f"the app holds more objects after 5x the requests (before, after): {grown}"
            assert len(asyncio.all_tasks()) <= tasks_before, [t.get_coro() for t in asyncio.all_tasks()]

            stats = await engine.get_stats()
            assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0, stats
            assert stats["num_preemptions"] > 0, "the load should preempt under 40 blocks"
    finally:
        server.should_exit = True
        await serving
        sock.close()
        await engine.shutdown()


def test_no_request_state_outlives_its_request_in_the_server() -> None:
    asyncio.run(_scenario())
