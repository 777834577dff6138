"""Client disconnects, 200 concurrent streams, and fuzzing with schemathesis, against the shared server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_helpers import ServerProcess, sse_events, wait_until

PROMPT = "The capital of France is"
ABORTED = 'rivulet:request_success_total{finished_reason="abort",model_name="smol"}'


def _idle(server: ServerProcess) -> bool:
    m = server.metrics()
    return (m["rivulet:num_requests_running"] == 0 and m["rivulet:num_requests_waiting"] == 0
            and m["rivulet:kv_cache_usage_perc"] == 0)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_frees_blocks(server: ServerProcess, route: str) -> None:
    body: dict[str, Any] = {"max_tokens": 400, "stream": True, "ignore_eos": True}
    body.update({"prompt": PROMPT} if "chat" not in route else {"messages": [{"role": "user", "content": "Hi"}]})
    aborted = server.metrics()[ABORTED]
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():  # (leaving this loop closes the connection)
            seen += line.startswith("data: ")
            if seen == 4:
                m = server.metrics()
                assert m["rivulet:num_requests_running"] == 1 and m["rivulet:kv_cache_usage_perc"] > 0
                break
    t0 = time.monotonic()
    assert wait_until(lambda: _idle(server), timeout=10), server.metrics()
    assert time.monotonic() - t0 < 10
    assert server.metrics()[ABORTED] == aborted + 1


def test_disconnect_while_waiting_for_a_full_answer_frees_blocks(server: ServerProcess) -> None:
    aborted = server.metrics()[ABORTED]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=1.5,
                   json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
    assert wait_until(lambda: _idle(server), timeout=10), server.metrics()
    assert server.metrics()[ABORTED] == aborted + 1


async def _one_stream(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
    if i % 2:
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Count to {i}."}]}
    else:
        route, body = "/v1/completions", {"prompt": f"Request number {i} says"}
    body.update({"max_tokens": 4, "stream": True, "n": 1 + (i % 3 == 0)})
    async with client.stream("POST", route, json=body) as r:
        lines = [line async for line in r.aiter_lines()]
    return {"status": r.status_code, "events": sse_events(lines), "n": body["n"]}


def test_200_concurrent_streams_each_answered_once(server: ServerProcess) -> None:
    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=server.url, timeout=180, limits=limits) as client:
            return await asyncio.gather(*[_one_stream(client, i) for i in range(200)])

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    ids = set()
    for res in results:
        assert res["status"] == 200
        events = res["events"]
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all("error" not in c for c in chunks)
        request_ids = {c["id"] for c in chunks}
        assert len(request_ids) == 1
        ids |= request_ids
        finishes = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert sorted(finishes) == list(range(res["n"]))
    assert len(ids) == 200
    assert wait_until(lambda: _idle(server), timeout=10)
    print(f"200 streams in {elapsed:.1f} s")


def test_schemathesis_finds_no_server_errors(server: ServerProcess, tmp_path: Path) -> None:
    here = Path(__file__).parent
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", "20", "--phases", "examples,coverage,fuzzing", "--workers", "1", "--seed", "1",
           "--request-timeout", "60", "--no-shrink",
           "--report-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and "Traceback" not in server.log()
