"""A server with an API key, a one-request running capacity and a one-request queue: 401s, overload
503s, and a graceful SIGTERM (the in-flight stream completes, the process exits 0)."""

from __future__ import annotations

import signal
import threading
from typing import Any, Iterator

import httpx
import openai
import pytest

from server_helpers import ServerProcess, assert_error_body, sse_events, wait_until

KEY = "sk-test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def limited() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-model-len", "512", "--api-key", KEY, "--max-num-seqs", "1", "--max-queue", "1",
                         "--drain-timeout", "60")
    try:
        yield proc
    finally:
        proc.stop()


def test_api_key_is_required_except_for_probes(limited: ServerProcess) -> None:
    url = limited.url
    err = assert_error_body(httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}), 401)
    assert err["code"] == "invalid_api_key"
    assert_error_body(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error_body(httpx.post(f"{url}/tokenize", json={"prompt": "hi"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited.base_url, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=limited.base_url, api_key=KEY, max_retries=0)
    assert good.completions.create(model="default", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{url}{path}").status_code == 200, path


def _stream_in_background(url: str, body: dict[str, Any], out: list[Any], first: threading.Event) -> threading.Thread:
    def run() -> None:
        with httpx.Client(timeout=120) as c, c.stream("POST", url, json=body, headers=AUTH) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    first.set()
            out.append((r.status_code, sse_events(lines)))
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_overload_is_answered_503_at_once(limited: ServerProcess) -> None:
    url = f"{limited.url}/v1/completions"
    long = {"prompt": PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True}
    outs: list[Any] = []
    events = [threading.Event(), threading.Event()]
    threads = [_stream_in_background(url, long, outs, e) for e in events]
    # one running, one waiting: the engine holds both
    assert wait_until(lambda: limited.metrics()["rivulet:num_requests_running"] == 1
                      and limited.metrics()["rivulet:num_requests_waiting"] == 1, timeout=30)
    r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 1}, headers=AUTH)
    assert len(outs) < 2, "the 503 must come while the queue is still full, not after it drained"
    err = assert_error_body(r, 503)
    assert r.headers["Retry-After"] == "1" and err["code"] == "server_overloaded"
    r = httpx.post(f"{limited.url}/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert_error_body(r, 503)
    assert limited.metrics()['rivulet:requests_rejected_total{model_name="default",reason="overloaded"}'] == 2
    for t in threads:
        t.join(120)
    assert [status for status, _ in outs] == [200, 200] and all(ev[-1] == "[DONE]" for _, ev in outs)
    ok = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 1}, headers=AUTH)
    assert ok.status_code == 200


def test_a_request_takes_one_slot_per_prompt(limited: ServerProcess) -> None:
    """Running capacity 1 + queue 1: two prompts fit an idle server, three never do (503 before the engine sees
    any of them), and a refused request (400) gives its slots back."""
    url = f"{limited.url}/v1/completions"
    served = limited.metrics()["rivulet:prompt_tokens_total"]
    r = httpx.post(url, json={"prompt": [PROMPT, PROMPT, PROMPT], "max_tokens": 1}, headers=AUTH)
    assert assert_error_body(r, 503)["code"] == "server_overloaded"
    assert limited.metrics()["rivulet:prompt_tokens_total"] == served  # none of the three was run
    r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 10_000}, headers=AUTH)
    assert_error_body(r, 400)
    r = httpx.post(url, json={"prompt": [PROMPT, PROMPT], "max_tokens": 1}, headers=AUTH)
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert limited.metrics()["rivulet:prompt_tokens_total"] > served


def test_sigterm_drains_in_flight_streams_then_exits_0(limited: ServerProcess) -> None:
    """Last in this module: it stops the server."""
    url = f"{limited.url}/v1/completions"
    outs: list[Any] = []
    started = threading.Event()
    t = _stream_in_background(url, {"prompt": PROMPT, "max_tokens": 40, "stream": True, "ignore_eos": True},
                              outs, started)
    assert started.wait(60)
    engine_pid = limited.engine_pid()
    limited.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: httpx.get(f"{limited.url}/v1/models", headers=AUTH).status_code == 503, timeout=10)
    refused = httpx.get(f"{limited.url}/v1/models", headers=AUTH)
    err = assert_error_body(refused, 503)
    assert err["code"] == "server_shutting_down"
    assert httpx.get(f"{limited.url}/health").status_code == 503
    t.join(120)
    status, events = outs[0]
    assert status == 200 and events[-1] == "[DONE]"
    finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    assert limited.proc.wait(60) == 0
    assert wait_until(lambda: not _alive(engine_pid), timeout=10)
    assert "Traceback" not in limited.log()


def test_a_second_sigterm_stops_at_once() -> None:
    """A drain of up to 60 s is cut short by a second signal: the server and its engine exit within seconds,
    the stream in flight is cut off without [DONE]."""
    proc = ServerProcess("--max-model-len", "512", "--drain-timeout", "60")
    try:
        lines: list[str] = []
        started, ended = threading.Event(), []

        def stream() -> None:
            body = {"prompt": PROMPT, "max_tokens": 480, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=120) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        lines.append(line)
                        started.set()
                ended.append("closed")
            except httpx.HTTPError as e:  # the connection dropped mid-response
                ended.append(type(e).__name__)
            started.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(60) and not ended, ended  # streaming, not refused
        engine_pid = proc.engine_pid()
        proc.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(f"{proc.url}/health").status_code == 503, timeout=10)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(5) == 0  # the stream alone would hold it for 480 tokens (8-16 s here)
        assert wait_until(lambda: not _alive(engine_pid), timeout=10)
        t.join(30)
        assert ended and "data: [DONE]" not in lines
    finally:
        proc.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_priority_orders_the_waiting_queue() -> None:
    """One running slot, taken: a request with a lower `priority` value that arrives later is served before one
    with a higher value that has waited longer (vLLM's convention: lower first)."""
    proc = ServerProcess("--max-model-len", "512", "--max-num-seqs", "1")
    try:
        url = f"{proc.url}/v1/completions"
        done: list[str] = []

        def post(name: str, **kw: Any) -> None:
            r = httpx.post(url, json={"prompt": PROMPT, "temperature": 0, **kw}, timeout=300)
            assert r.status_code == 200, r.text
            done.append(name)

        def count(kind: str) -> float:
            return proc.metrics()[f"rivulet:num_requests_{kind}"]

        blocker = threading.Thread(target=post, args=("blocker",), kwargs=dict(max_tokens=200, ignore_eos=True))
        blocker.start()
        assert wait_until(lambda: count("running") == 1, timeout=60)
        later = threading.Thread(target=post, args=("later",), kwargs=dict(max_tokens=2, priority=5))
        later.start()
        assert wait_until(lambda: count("waiting") == 1, timeout=60)
        sooner = threading.Thread(target=post, args=("sooner",), kwargs=dict(max_tokens=2, priority=-1))
        sooner.start()
        assert wait_until(lambda: count("waiting") == 2, timeout=60)
        for t in (blocker, later, sooner):
            t.join(300)
        assert done == ["blocker", "sooner", "later"]
    finally:
        proc.stop()
