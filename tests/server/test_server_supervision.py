"""Engine supervision inside one ``rivulet serve``: a killed engine is restarted, a stopped (hung) one is found by
the watchdog and restarted, and past --max-engine-restarts the server exits 1. Also /health_generate, the request
size limit, and a large prompt tokenized off the event loop while other streams run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Iterator

import httpx
import pytest

from server_helpers import ServerProcess, assert_error_body, wait_until


@pytest.fixture(scope="module")
def supervised() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-model-len", "512", "--engine-watchdog-s", "3", "--max-engine-restarts", "2",
                         "--max-request-bytes", str(24 << 20))
    try:
        yield proc
    finally:
        proc.stop()


def stream_until_error(url: str, after: int, action) -> tuple[list[dict], float]:
    """Stream a long completion, call `action()` after `after` chunks; returns the chunks and the seconds from the
    action to the stream's end."""
    body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
    chunks, acted = [], None
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == after:
                    action()
                    acted = time.monotonic()
    assert acted is not None
    return chunks, time.monotonic() - acted


def back_up(server: ServerProcess, old_pid: int) -> int:
    assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=120), server.log()
    pid = server.engine_pid()
    assert pid != old_pid
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    return pid


def test_health_generate_and_request_size_limit(supervised: ServerProcess) -> None:
    assert httpx.get(supervised.url + "/health_generate", timeout=60).status_code == 200
    assert httpx.get(supervised.url + "/health", params={"generate": 1}, timeout=60).status_code == 200
    big = json.dumps({"prompt": "x" * (25 << 20), "max_tokens": 1})
    r = httpx.post(supervised.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert assert_error_body(r, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)].encode()
    r = httpx.post(supervised.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert assert_error_body(r, 413)["code"] == "request_too_large"


def test_large_prompts_do_not_stall_other_streams(supervised: ServerProcess) -> None:
    """While 16 streams run: a 20 MB prompt is refused at once (more characters than any prompt that fits the
    512-token context: the tokenizer's longest entry is 81 characters), and a 150 kB one, which may fit as far as
    its length says, is tokenized in a thread and refused after. The streams' largest gap between chunks stays
    under 1.5 s (tokenizing 4 MB on the event loop stalled them ~2.6 s)."""
    gaps: list[float] = []
    started = threading.Barrier(17)

    def one() -> None:
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as c, c.stream("POST", supervised.url + "/v1/completions", json=body) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if last is None:
                        started.wait()
                    else:
                        gaps.append(now - last)
                    last = now
    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.monotonic()
    huge = httpx.post(supervised.url + "/v1/completions", json={"prompt": "word " * (4 << 20), "max_tokens": 1},
                      timeout=120)
    huge_s = time.monotonic() - t0
    chat = httpx.post(supervised.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "word " * (4 << 20)}], "max_tokens": 1})
    large = httpx.post(supervised.url + "/v1/completions", json={"prompt": "word " * 30_000, "max_tokens": 1},
                       timeout=120)
    for t in threads:
        t.join()
    for r in (huge, chat):
        err = assert_error_body(r, 400)
        assert err["code"] == "context_length_exceeded" and "20971520 characters" in err["message"], err
    assert huge_s < 5, huge_s
    err = assert_error_body(large, 400)
    assert err["code"] == "context_length_exceeded" and "the request needs" in err["message"], err
    assert gaps and max(gaps) < 1.5, max(gaps)


def test_killed_then_hung_engine_restarts_then_server_gives_up(supervised: ServerProcess) -> None:
    pid = supervised.engine_pid()
    chunks, took = stream_until_error(supervised.url, 3, lambda: os.kill(pid, signal.SIGKILL))
    assert chunks[-1]["error"]["code"] == "engine_dead" and took < 2
    r = httpx.get(supervised.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] in ("engine_restarting", "engine_dead")
    pid = back_up(supervised, pid)

    stopped = pid  # SIGSTOP: alive but stuck; the watchdog (3 s) kills it
    chunks, took = stream_until_error(supervised.url, 3, lambda: os.kill(stopped, signal.SIGSTOP))
    assert chunks[-1]["error"]["code"] == "engine_dead" and "stuck" in chunks[-1]["error"]["message"]
    assert 2.5 < took < 8
    pid = back_up(supervised, pid)

    os.kill(pid, signal.SIGKILL)  # a third death within 10 minutes: past --max-engine-restarts 2
    supervised.proc.wait(60)
    assert supervised.proc.returncode == 1
    assert "stopping the server" in supervised.log()
