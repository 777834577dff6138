"""The router's Prometheus metrics (its own registry; ``GET /metrics``)."""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rivulet.router.workers import WorkerPool


class _WorkerGauges(Collector):
    """Per-worker gauges read at scrape time."""

    def __init__(self, pool: Callable[[], WorkerPool]) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        pool = self.pool()
        now = time.monotonic()
        healthy = GaugeMetricFamily("rivulet:router_worker_healthy", "1 when the worker passes its health checks",
                                    labels=["worker"])
        breaker = GaugeMetricFamily("rivulet:router_worker_breaker_open", "1 while the worker's circuit breaker is open",
                                    labels=["worker"])
        inflight = GaugeMetricFamily("rivulet:router_worker_in_flight", "requests the router has open on the worker",
                                     labels=["worker"])
        queue = GaugeMetricFamily("rivulet:router_worker_engine_queue",
                                  "running + waiting requests the worker's /metrics reported", labels=["worker"])
        for w in pool.workers.values():
            healthy.add_metric([w.url], float(w.healthy))
            breaker.add_metric([w.url], float(w.breaker_state(now, pool.breaker) == "open"))
            inflight.add_metric([w.url], float(w.in_flight))
            queue.add_metric([w.url], w.engine_queue)
        yield from (healthy, breaker, inflight, queue)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rivulet:router_requests", "requests answered, by worker and HTTP status",
                                ["worker", "status"], registry=r)
        self.retries = Counter("rivulet:router_retries", "attempts retried on another worker, by reason", ["reason"],
                               registry=r)
        self.failovers = Counter("rivulet:router_stream_failovers",
                                 "streams whose worker failed mid-way: resumed elsewhere or failed", ["outcome"],
                                 registry=r)
        self.decisions = Counter("rivulet:router_routing_decisions", "why a request went to its worker",
                                 ["policy", "reason"], registry=r)
        self.first_byte = Histogram("rivulet:router_time_to_first_byte_seconds",
                                    "from the request's arrival to the worker's answer (headers)", registry=r,
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

    def watch(self, pool: Callable[[], WorkerPool]) -> None:
        self.registry.register(_WorkerGauges(pool))

    def retry(self, reason: str) -> None:
        self.retries.labels(reason).inc()

    def failover(self, outcome: str) -> None:
        self.failovers.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
