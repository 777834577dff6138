"""``rivulet router`` in front of fake workers on loopback: routing, retries before the first byte, streams
resumed after it (the client sees one stream with the tokens an unbroken run gives), worker management, metrics."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Iterator

import httpx
import pytest

from fake_worker import FakeWorker, ThreadServer, chat_prompt, generate, prompt_ids, text_of
from rivulet.router.app import build_router
from rivulet.router.cli import add_router_args


def router_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(list(argv))


@pytest.fixture
def workers() -> Iterator[list[FakeWorker]]:
    ws = [FakeWorker("a"), FakeWorker("b")]
    yield ws
    for w in ws:
        w.stop()


def start_router(workers: list[FakeWorker], *flags: str) -> tuple[ThreadServer, Any]:
    router = build_router(router_args("--worker-urls", *[w.url for w in workers], "--retry-initial-backoff-ms", "1",
                                      "--health-check-interval-secs", "0.2", *flags))
    return ThreadServer(router.app), router


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def stream(client: httpx.Client, url: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_streams_resume_on_another_worker_exactly(workers: list[FakeWorker], client: httpx.Client) -> None:
    a, b = workers
    a.state.die_after = 3  # every stream on a drops after 3 tokens
    server, _ = start_router(workers, "--policy", "round_robin")
    try:
        for i in range(4):  # half of them start on a
            prompt = f"prompt number {i}"
            events = stream(client, server.url + "/v1/completions",
                            {"prompt": prompt, "max_tokens": 10, "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            chunks = events[:-1]
            assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all("error" not in c for c in chunks)
            want = generate(prompt_ids({"prompt": prompt}), 10)
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text_of(want)
            assert all("token_ids" not in c["choices"][0] for c in chunks if c["choices"])  # the client did not ask
            assert chunks[-1]["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 10, "total_tokens":
                                           len(prompt) + 10}
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        resumed = [r for r in b.state.requests if isinstance(r["prompt"], list)]
        assert len(resumed) == 2 and all(r["max_tokens"] == 7 and len(r["prompt"]) == len("prompt number 0") + 3
                                         for r in resumed)
        # a chat stream: the resumed completion comes back as chat deltas
        messages = [{"role": "user", "content": "hi there"}]
        for _ in range(2):
            events = stream(client, server.url + "/v1/chat/completions",
                            {"messages": messages, "max_tokens": 8, "return_token_ids": True})
            chunks = events[:-1]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            want = generate(chat_prompt(messages), 8)
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text_of(want)
            assert sum((c["choices"][0].get("token_ids") or [] for c in chunks), []) == want  # asked: kept
        metrics = client.get(server.url + "/metrics").text
        assert 'rivulet:router_stream_failovers_total{outcome="resumed"}' in metrics
    finally:
        server.stop()


def test_in_stream_engine_error_resumes_and_unresumable_streams_end_with_an_error(
        workers: list[FakeWorker], client: httpx.Client) -> None:
    a, b = workers
    a.state.error_event_after = 2
    server, _ = start_router(workers, "--policy", "round_robin")
    try:
        events = stream(client, server.url + "/v1/completions", {"prompt": "abc", "max_tokens": 6})
        assert "".join(c["choices"][0]["text"] for c in events[:-1]) == text_of(generate(prompt_ids({"prompt": "abc"}), 6))
        b.state.die_after = 2
        events = stream(client, server.url + "/v1/completions", {"prompt": "abc", "max_tokens": 6, "n": 2})
        assert events[-1] == "[DONE]" and "n > 1" in events[-2]["error"]["message"]  # no hang, a clear error
    finally:
        server.stop()


def test_retries_before_the_first_byte_and_breaker(workers: list[FakeWorker], client: httpx.Client) -> None:
    a, b = workers
    a.state.status = 500
    server, router = start_router(workers, "--policy", "round_robin", "--cb-failure-threshold", "2")
    try:
        for i in range(6):
            r = client.post(server.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["worker"] == "b"
        assert 0 < len(a.state.requests) <= 2  # the breaker opened after 2 failures
        assert router.pool.workers[a.url].breaker_state(time.monotonic(), router.pool.breaker) == "open"
        b.state.status = 400  # a client error is not retried
        r = client.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400 and len(b.state.requests) == 7
        b.state.status = 500  # every worker failing: the last 5xx goes back
        assert client.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 500
        r = client.post(server.url + "/v1/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    finally:
        server.stop()


def test_dead_worker_is_skipped_then_workers_api(workers: list[FakeWorker], client: httpx.Client) -> None:
    a, b = workers
    server, router = start_router(workers, "--policy", "round_robin")
    try:
        a.stop()  # connection refused from now on
        for i in range(4):
            r = client.post(server.url + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": f"m{i}"}], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["worker"] == "b"
        assert not router.pool.workers[a.url].healthy
        listed = client.get(server.url + "/workers").json()
        assert listed["policy"] == "round_robin" and {w["url"]: w["healthy"] for w in listed["workers"]} == \
            {a.url: False, b.url: True}
        assert client.delete(server.url + "/workers", params={"url": a.url}).json()["removed"]
        assert client.delete(server.url + "/workers", params={"url": a.url}).status_code == 404
        assert client.post(server.url + "/workers", json={}).status_code == 400
        c = FakeWorker("c")
        try:
            assert client.post(server.url + "/workers", json={"url": c.url}).json() == {"url": c.url, "healthy": True}
            names = {client.post(server.url + "/v1/completions", json={"prompt": f"q{i}"}).json()["worker"]
                     for i in range(4)}
            assert names == {"b", "c"}
            assert client.get(server.url + "/health").status_code == 200
            b.stop()
            c.stop()
            r = client.post(server.url + "/v1/completions", json={"prompt": "q"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
            assert client.get(server.url + "/health").status_code == 503
        finally:
            c.stop()
        metrics = client.get(server.url + "/metrics").text
        assert "rivulet:router_worker_healthy" in metrics and "rivulet:router_retries_total" in metrics
    finally:
        server.stop()


def test_cache_aware_keeps_a_prefix_on_one_worker(workers: list[FakeWorker], client: httpx.Client) -> None:
    server, _ = start_router(workers, "--policy", "cache_aware")
    try:
        docs = {d: d * 200 for d in "XYZW"}
        for i in range(3):
            for d, doc in docs.items():
                r = client.post(server.url + "/v1/completions", json={"prompt": f"{doc} question {i}", "max_tokens": 1})
                assert r.status_code == 200
        homes: dict[str, set[str]] = {}
        for w in workers:
            for req in w.state.requests:
                homes.setdefault(req["prompt"][0], set()).add(w.state.name)
        assert all(len(v) == 1 for v in homes.values()) and len({next(iter(v)) for v in homes.values()}) == 2
        assert 'reason="prefix"' in client.get(server.url + "/metrics").text
    finally:
        server.stop()


def test_rivulet_router_command(workers: list[FakeWorker], client: httpx.Client) -> None:
    import subprocess
    import sys

    from fake_worker import free_port

    bad = subprocess.run([sys.executable, "-m", "rivulet.entrypoints.cli", "router", "--cache-threshold", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == \
        "rivulet: error: --cache-threshold must be in [0, 1]"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rivulet.entrypoints.cli", "router", "--port", str(port),
                             "--worker-urls", *[w.url for w in workers], "--policy", "power_of_two"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if client.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        events = stream(client, url + "/v1/completions", {"prompt": "cli", "max_tokens": 4})
        assert "".join(c["choices"][0]["text"] for c in events[:-1]) == text_of(generate(prompt_ids({"prompt": "cli"}), 4))
        assert client.get(url + "/v1/models").json()["data"][0]["id"] == "fake"
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "routing over 2 workers with power_of_two" in out
