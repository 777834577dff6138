"""`rivulet bench serve`: an asyncio load generator that speaks only OpenAI HTTP (streaming
`/v1/completions` or `/v1/chat/completions` with `stream_options.include_usage`), so Rivulet and any
peer server are measured the same way.

Requests arrive as a Poisson process (`burstiness` 1) or a gamma process (burstiness < 1: burstier,
> 1: more regular) at `request_rate` per second (inf: all at once), at most `max_concurrency` in flight,
bounded by `max_duration_s` (requests still running then are cancelled and reported as `incomplete`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from rivulet.bench.datasets import SampleRequest
from rivulet.bench.metrics import RequestResult, summarize
from rivulet.config import RivuletError


@dataclass
class LoadConfig:
    """How one point of the benchmark sends its requests."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    burstiness: float = 1.0
    max_duration_s: float | None = None
    seed: int = 0


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    temperature: float = 0.0
    sampling: dict[str, float] = field(default_factory=dict)  # top_p / top_k / min_p where given
    ignore_eos: bool = False
    eos_logit_bias: list[int] = field(default_factory=list)  # token ids to bias by -100 (peers without ignore_eos)
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def normalize_base_url(url: str) -> str:
    """'http://h:p/v1/' -> 'http://h:p'; a RivuletError for something that is not an http(s) URL."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise RivuletError(f"bad --base-url {url!r}: expected http://HOST:PORT")
    return url


def payload(cfg: ClientConfig, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model or cfg.model, "max_tokens": req.output_len, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}, **cfg.sampling}
    if cfg.endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise RivuletError("--endpoint chat needs text prompts (--prompt-format text)")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.eos_logit_bias:
        body["logit_bias"] = {str(t): -100 for t in cfg.eos_logit_bias}
    body.update(cfg.extra_body)
    return body


def _chunk_text(obj: dict[str, Any], chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if chat:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


async def send_request(client: httpx.AsyncClient, cfg: ClientConfig, req: SampleRequest, t0: float) -> RequestResult:
    """One streaming request; every failure is recorded in the result, never raised."""
    res = RequestResult(prompt_len=req.prompt_len)
    chat = cfg.endpoint == "chat"
    chunks = 0
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    res.start = start - t0
    last = start
    try:
        async with client.stream("POST", cfg.api_url, json=payload(cfg, req), headers=cfg.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {resp.status_code}: {str(body)[:300]}"
                res.latency = time.perf_counter() - start
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                if "error" in obj:
                    res.error = f"stream error: {str(obj['error'])[:300]}"
                    break
                if _chunk_text(obj, chat):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
    except (httpx.HTTPError, ValueError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300] or type(e).__name__
        res.latency = time.perf_counter() - start
        return res
    if usage:
        res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
        res.output_tokens = int(usage.get("completion_tokens") or chunks)
    else:
        res.output_tokens = chunks
    if not res.error and chunks == 0:
        res.error = "the stream ended without any generated text"
    res.success = not res.error
    return res


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start) of n requests: gamma(shape=burstiness) gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


async def run_load(cfg: ClientConfig, requests: Sequence[SampleRequest], load: LoadConfig,
                   progress: Callable[[], None] | None = None) -> tuple[list[RequestResult], float, int]:
    """Send `requests` under `load`; returns (finished results, wall time in s, number cancelled at the time limit)."""
    offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, load.seed)
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + load.max_duration_s if load.max_duration_s else math.inf

        async def one(req: SampleRequest) -> None:
            if sem is not None:
                async with sem:
                    if time.perf_counter() >= deadline:
                        return
                    r = await send_request(client, cfg, req, t0)
            else:
                r = await send_request(client, cfg, req, t0)
            results.append(r)
            if progress:
                progress()

        tasks: list[asyncio.Task[None]] = []
        for req, at in zip(requests, offsets):
            delay = t0 + at - time.perf_counter()
            if t0 + at >= deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        if tasks:
            timeout = None if math.isinf(deadline) else max(deadline - time.perf_counter(), 0.0)
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        # requests that never ran (time limit) are not failures
        cancelled = len(requests) - len(results)
        elapsed = min(time.perf_counter(), deadline) - t0
    return results, elapsed, cancelled


async def check_server(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """The model ids the server lists at /v1/models; a one-line RivuletError when it cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.get(f"{base_url}/v1/models", headers=headers)
    except httpx.HTTPError as e:
        raise RivuletError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise RivuletError(f"{base_url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise RivuletError(f"{base_url}/v1/models did not return an OpenAI model list") from None


async def warm_up(cfg: ClientConfig, req: SampleRequest, n: int) -> None:
    """n short requests before measuring; a RivuletError if the server rejects them (bad model, auth...)."""
    short = SampleRequest(req.prompt, req.prompt_len, min(req.output_len, 8))
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=10.0)) as client:
        for _ in range(n):
            r = await send_request(client, cfg, short, time.perf_counter())
            if not r.success:
                raise RivuletError(f"the warm-up request failed: {r.error}")


_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def scrape_metrics(base_url: str) -> str | None:
    """The server's /metrics text, or None where it has none."""
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def parse_cache_counters(text: str) -> dict[str, float] | None:
    """Prefix-cache queries and hits in tokens (`rivulet:` or `vllm:prefix_cache_{queries,hits}_total`) and
    the KV tier's block hits per tier (`rivulet:kv_tier_hits_total{tier=...}` -> "tier_hits_<tier>"), summed
    over the other labels; None where the server counts no prefix-cache queries."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        metric = name.split("{", 1)[0].split(":", 1)[-1]
        key = {"prefix_cache_queries_total": "queries", "prefix_cache_hits_total": "hits"}.get(metric)
        if metric == "kv_tier_hits_total" and 'tier="' in name:
            key = "tier_hits_" + name.split('tier="', 1)[1].split('"', 1)[0]
        if key is not None:
            found[key] = found.get(key, 0.0) + float(value.split()[0])
    return found if "queries" in found else None


def cache_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """What one point added: prefix-cache queries and hits (tokens), the hit rate, and KV tier hits (blocks)."""
    if after is None:
        return None
    d: dict[str, Any] = {k: int(after[k] - (before or {}).get(k, 0)) for k in sorted(after)}
    d["hit_rate"] = d["hits"] / d["queries"] if d["queries"] else 0.0
    return d


def parse_spec_counters(text: str) -> dict[str, float] | None:
    """The counters of `spec_decode_counters` from Prometheus text."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        metric = name.split("{", 1)[0].split(":", 1)[-1]
        for key in _SPEC_COUNTERS:
            if metric == f"spec_decode_{key}_total":
                found[key] = found.get(key, 0.0) + float(value.split()[0])
    return found if "num_drafts" in found else None


def spec_decode_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """What one point added to the counters: drafts, draft and accepted tokens, acceptance rate and
    mean acceptance length (tokens per verify step: accepted drafts + 1)."""
    if after is None:
        return None
    d = {k: int(after.get(k, 0) - (before or {}).get(k, 0)) for k in _SPEC_COUNTERS}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    return d


def run_point(cfg: ClientConfig, requests: Sequence[SampleRequest], load: LoadConfig,
              slo: dict[str, float] | None = None, use_tqdm: bool = True, desc: str = "") -> dict[str, Any]:
    """One benchmark point: the load's settings plus the metrics summary (and the server's prefix-cache and
    speculative decoding counters over the point, where it has them)."""
    from tqdm import tqdm

    text = scrape_metrics(cfg.base_url)
    spec_before = parse_spec_counters(text) if text else None
    cache_before = parse_cache_counters(text) if text else None
    bar = tqdm(total=len(requests), desc=desc or "requests", unit="req", disable=not use_tqdm, leave=False)
    try:
        results, elapsed, cancelled = asyncio.run(run_load(cfg, requests, load, lambda: bar.update(1)))
    finally:
        bar.close()
    point: dict[str, Any] = {"request_rate": None if math.isinf(load.request_rate) else load.request_rate,
                             "max_concurrency": load.max_concurrency, "burstiness": load.burstiness,
                             "num_prompts": len(requests), "incomplete": cancelled}
    point.update(summarize(results, elapsed, slo))
    text = scrape_metrics(cfg.base_url) if text else None
    spec = spec_decode_summary(spec_before, parse_spec_counters(text) if text and spec_before else None)
    if spec is not None:
        point["spec_decode"] = spec
    cache = cache_summary(cache_before, parse_cache_counters(text) if text else None)
    if cache is not None:
        point["prefix_cache"] = cache
    return point


def load_points(base: LoadConfig, sweep: Sequence[float] | None, sweep_over: str) -> list[LoadConfig]:
    """The load of each point: `base` alone, or one per sweep value over max_concurrency or request_rate."""
    if not sweep:
        return [base]
    out = []
    for v in sweep:
        d = asdict(base)
        if sweep_over == "rate":
            d["request_rate"] = float(v)
        else:
            d["max_concurrency"] = int(v)
        out.append(LoadConfig(**d))
    return out
