"""The load generator against a fake OpenAI server with known delays: TTFT/TPOT/ITL measured within
tolerance, concurrency and request-rate limits respected, time bound, errors reported."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from rivulet.bench.datasets import SampleRequest
from rivulet.bench.serve import ClientConfig, LoadConfig, arrival_offsets, check_server, normalize_base_url, \
    run_point
from rivulet.config import RivuletError


def _reqs(n: int, out: int, prompt: object = "hello") -> list[SampleRequest]:
    return [SampleRequest(prompt, 7, out) for _ in range(n)]  # type: ignore[arg-type]


def test_ttft_tpot_itl_are_measured(fake):
    fake.state.ttft, fake.state.tpot = 0.2, 0.05
    cfg = ClientConfig(base_url=fake.url, model="fake", ignore_eos=True)
    p = run_point(cfg, _reqs(4, 9), LoadConfig(max_concurrency=4), slo={"ttft": 1000, "tpot": 100}, use_tqdm=False)
    assert p["completed"] == 4 and p["failed"] == 0 and p["total_output_tokens"] == 36
    # the fake server sleeps at least its delays; a loaded machine only adds: tight below, loose above
    assert 180 <= p["median_ttft_ms"] <= 400
    assert 45 <= p["median_tpot_ms"] <= 100 and 45 <= p["median_itl_ms"] <= 100
    assert 180 + 8 * 45 <= p["median_e2el_ms"] <= 2 * (200 + 8 * 50)
    assert p["good_requests"] == 4
    # all 4 ran at once: about one request's time (0.6 s), not four in turn (2.4 s)
    assert p["duration_s"] < 1.8
    assert p["output_throughput"] == pytest.approx(36 / p["duration_s"])
    body = fake.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 9 and body["model"] == "fake"


def test_chat_endpoint_skips_the_role_chunk(fake):
    fake.state.ttft, fake.state.tpot = 0.15, 0.02
    cfg = ClientConfig(base_url=fake.url, model="fake", endpoint="chat")
    p = run_point(cfg, _reqs(2, 5), LoadConfig(max_concurrency=2), use_tqdm=False)
    assert p["completed"] == 2 and 135 <= p["median_ttft_ms"] <= 300  # the role chunk (sent at once) is not a token
    assert fake.state.bodies[0]["messages"] == [{"role": "user", "content": "hello"}]


def test_max_concurrency_is_respected(fake):
    fake.state.ttft, fake.state.tpot = 0.05, 0.01
    cfg = ClientConfig(base_url=fake.url, model="fake")
    p = run_point(cfg, _reqs(12, 5), LoadConfig(max_concurrency=3), use_tqdm=False)
    assert p["completed"] == 12
    assert fake.state.max_in_flight == 3
    assert p["duration_s"] > 4 * 0.09  # 4 waves of 3


def test_request_rate_paces_arrivals(fake):
    fake.state.ttft, fake.state.tpot = 0.01, 0.01
    cfg = ClientConfig(base_url=fake.url, model="fake")
    p = run_point(cfg, _reqs(10, 2), LoadConfig(request_rate=20.0, burstiness=1e6, seed=1), use_tqdm=False)
    arrivals = np.diff(fake.state.arrivals)
    assert p["completed"] == 10
    # burstiness -> inf: evenly spaced at 1/rate
    assert 0.04 <= float(np.median(arrivals)) <= 0.1
    assert 9 * 0.05 * 0.8 < fake.state.arrivals[-1] - fake.state.arrivals[0] < 9 * 0.05 * 3  # not a burst


def test_arrival_offsets_are_poisson_or_gamma():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    poisson = np.diff(arrival_offsets(20000, 10.0, 1.0, 0))
    assert poisson.mean() == pytest.approx(0.1, rel=0.05) and poisson.std() == pytest.approx(0.1, rel=0.05)
    bursty = np.diff(arrival_offsets(20000, 10.0, 0.25, 0))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05) and bursty.std() == pytest.approx(0.2, rel=0.08)


def test_max_duration_bounds_the_run(fake):
    fake.state.ttft, fake.state.tpot = 0.05, 0.05
    cfg = ClientConfig(base_url=fake.url, model="fake")
    p = run_point(cfg, _reqs(50, 10), LoadConfig(max_concurrency=2, max_duration_s=1.0), use_tqdm=False)
    assert p["duration_s"] <= 1.5  # cut at 1 s (the whole run would take ~14 s); room for a loaded machine
    assert 1 <= p["completed"] <= 6 and p["incomplete"] == 50 - p["completed"] and p["failed"] == 0


def test_http_errors_are_counted_with_their_message(fake):
    fake.state.ttft, fake.state.tpot, fake.state.fail_every = 0.01, 0.01, 2
    cfg = ClientConfig(base_url=fake.url, model="fake")
    p = run_point(cfg, _reqs(6, 3), LoadConfig(max_concurrency=1), use_tqdm=False)
    assert p["completed"] == 3 and p["failed"] == 3
    assert p["errors"] == ["HTTP 500: boom"] * 3


def test_token_id_prompts_and_usage_prompt_tokens(fake):
    fake.state.ttft, fake.state.tpot = 0.01, 0.01
    cfg = ClientConfig(base_url=fake.url, model="fake")
    p = run_point(cfg, _reqs(2, 3, prompt=[5, 6, 7, 8]), LoadConfig(max_concurrency=2), use_tqdm=False)
    assert fake.state.bodies[0]["prompt"] == [5, 6, 7, 8]
    assert p["total_input_tokens"] == 8  # from the usage chunk


def test_unreachable_server_and_url_normalization(fake):
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(RivuletError, match="bad --base-url"):
        normalize_base_url("localhost:8000")
    with pytest.raises(RivuletError, match="cannot reach"):
        asyncio.run(check_server("http://127.0.0.1:9", None, timeout_s=2))
    assert asyncio.run(check_server(fake.url, None)) == ["fake"]
