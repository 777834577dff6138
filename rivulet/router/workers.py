"""The workers a router sends requests to: their health, load and circuit breakers.

A worker is *available* when its health checks pass and its breaker is not open. Health: ``GET
/health`` every ``interval`` seconds; ``failure_threshold`` failures in a row mark it unhealthy,
``success_threshold`` successes healthy again. The same probe scrapes ``/metrics`` for the
engine's queue (``rivulet:`` or ``vllm:`` ``num_requests_running`` + ``num_requests_waiting``).
Breaker: ``cb_failures`` failed requests in a row open it; after ``cb_timeout`` seconds it lets
one request through (half-open): a success closes it, a failure opens it again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

from rivulet.router.upstream import ConnectError, ResponseError, Upstream

logger = logging.getLogger("rivulet.router")

_QUEUE = re.compile(r"^(?:rivulet|vllm):num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


@dataclass
class HealthConfig:
    interval: float = 5.0
    timeout: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"


@dataclass
class BreakerConfig:
    failures: int = 5  # failed requests in a row that open the breaker; 0 disables it
    timeout: float = 30.0  # seconds open before one request may try (half-open)


@dataclass
class Worker:
    url: str
    healthy: bool = True  # optimistic until the first probes say otherwise
    in_flight: int = 0  # requests this router has open on it
    engine_queue: float = 0.0  # running + waiting requests, from its /metrics
    failures_in_row: int = 0
    opened_at: float | None = None  # when the breaker opened; None: closed
    probe_fails: int = 0
    probe_oks: int = 0
    served: int = 0
    failed: int = 0
    models: list[str] = field(default_factory=list)

    @property
    def load(self) -> float:
        return max(float(self.in_flight), self.engine_queue)

    def breaker_state(self, now: float, cfg: BreakerConfig) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if now - self.opened_at >= cfg.timeout else "open"


class WorkerPool:
    """The workers by URL, and the probe loop that keeps their health and load current."""

    def __init__(self, urls: list[str], health: HealthConfig, breaker: BreakerConfig) -> None:
        self.health, self.breaker = health, breaker
        self.workers: dict[str, Worker] = {}
        for url in urls:
            self.add(url)
        self._client: Upstream | None = None
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def normalize(url: str) -> str:
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        return url

    def add(self, url: str) -> Worker:
        url = self.normalize(url)
        if url not in self.workers:
            self.workers[url] = Worker(url)
        return self.workers[url]

    def remove(self, url: str) -> Worker | None:
        return self.workers.pop(self.normalize(url), None)

    def available(self, exclude: set[str] = frozenset()) -> list[Worker]:  # type: ignore[assignment]
        """Workers a request may go to now (healthy, breaker closed or half-open), minus `exclude`."""
        now = time.monotonic()
        out = []
        for w in self.workers.values():
            if w.url in exclude or not w.healthy:
                continue
            state = w.breaker_state(now, self.breaker)
            if state == "open" or (state == "half_open" and w.in_flight > 0):
                continue
            out.append(w)
        return out

    # ---- outcomes of requests ----

    def succeeded(self, w: Worker) -> None:
        w.served += 1
        w.failures_in_row = 0
        if w.opened_at is not None:
            logger.info("worker %s answered again: breaker closed", w.url)
        w.opened_at = None

    def failed(self, w: Worker, reason: str) -> None:
        w.failed += 1
        w.failures_in_row += 1
        cfg = self.breaker
        if cfg.failures and w.failures_in_row >= cfg.failures:
            if w.opened_at is None:
                logger.warning("worker %s failed %d requests in a row (%s): breaker open for %.0f s", w.url,
                               w.failures_in_row, reason, cfg.timeout)
            w.opened_at = time.monotonic()

    def connection_lost(self, w: Worker, reason: str) -> None:
        """The worker refused or dropped a connection: unhealthy until its probes pass again."""
        self.failed(w, reason)
        if w.healthy:
            logger.warning("worker %s is unreachable (%s): marked unhealthy", w.url, reason)
        w.healthy, w.probe_oks = False, 0

    # ---- probes ----

    def start(self) -> None:
        self._client = Upstream(connect_timeout=self.health.timeout, read_timeout=self.health.timeout)
        self._task = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(w) for w in list(self.workers.values())), return_exceptions=True)
            await asyncio.sleep(self.health.interval)

    async def _get(self, url: str, path: str) -> tuple[int, bytes]:
        assert self._client is not None
        r = await self._client.request("GET", url, path)
        try:
            return r.status, await r.read()
        finally:
            r.release()

    async def probe(self, w: Worker) -> bool:
        """One health check (and a load scrape) of `w`; updates its state; True when it passed."""
        assert self._client is not None
        cfg = self.health
        try:
            status, _ = await asyncio.wait_for(self._get(w.url, cfg.endpoint), cfg.timeout)
            ok = status == 200
            if ok:
                status, text = await asyncio.wait_for(self._get(w.url, "/metrics"), cfg.timeout)
                if status == 200:
                    w.engine_queue = sum(float(v) for v in _QUEUE.findall(text.decode("utf-8", "replace")))
        except (ConnectError, ResponseError, asyncio.TimeoutError, ValueError):
            ok = False
        if ok:
            w.probe_fails, w.probe_oks = 0, w.probe_oks + 1
            if not w.healthy and w.probe_oks >= cfg.success_threshold:
                logger.info("worker %s is healthy again", w.url)
                w.healthy = True
        else:
            w.probe_oks, w.probe_fails = 0, w.probe_fails + 1
            if w.healthy and w.probe_fails >= cfg.failure_threshold:
                logger.warning("worker %s failed %d health checks: marked unhealthy", w.url, w.probe_fails)
                w.healthy = False
        return ok
