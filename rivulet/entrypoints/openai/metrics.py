"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (no process-global state); each model of
a deployment has a ``ServerMetrics`` over the same families (``like=``), told apart by ``model_name``.

Names follow vLLM's with a ``rivulet:`` prefix. Engine-side numbers (running/waiting requests, KV
cache usage, prefix-cache counters, preemptions, speculative decoding's draft and accepted tokens)
are read from ``engine.get_stats()`` when
``/metrics`` is scraped; request-side numbers (tokens, finish reasons, latencies) are recorded
here as outputs stream through the server.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from rivulet.engine.outputs import PoolingRequestOutput, RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """All metrics of one app; ``render()`` gives the Prometheus text format."""

    def __init__(self, model_name: str, like: ServerMetrics | None = None) -> None:
        """Metrics of `model_name`; `like`: another model's of the same server, whose registry and metric
        families these share (one family per name, a `model_name` label per model)."""
        self.model_name = model_name
        self._last_engine: dict[str, float] = {}
        if like is None:
            self._create_families()
        else:
            self.registry = like.registry
            self.__dict__.update({k: v for k, v in vars(like).items() if isinstance(v, MetricWrapperBase)})
        # every series present from the start, so rates work from zero
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_hit_rate, self.prefix_queries,
                       self.prefix_hits, self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft,
                       self.tpot, self.itl, self.e2e, self.queue_time):
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)

    def _create_families(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("rivulet:num_requests_running", "Sequences the scheduler is running.")
        self.waiting = gauge("rivulet:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("rivulet:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prefix_hit_rate = gauge("rivulet:prefix_cache_hit_rate",
                                     "Prefix-cache hits / queries since start (0 before any query).")
        self.prefix_queries = counter("rivulet:prefix_cache_queries", "Prefix-cache lookups (tokens queried).")
        self.prefix_hits = counter("rivulet:prefix_cache_hits", "Prefix-cache hits (tokens found).")
        self.preemptions = counter("rivulet:num_preemptions", "Requests preempted by the scheduler.")
        self.spec_drafts = counter("rivulet:spec_decode_num_drafts",
                                   "Speculative decoding: verify steps of a request that carried draft tokens.")
        self.spec_draft_tokens = counter("rivulet:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("rivulet:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("rivulet:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft (0: first).",
                                             ("position",))
        self.tier_hits = counter("rivulet:kv_tier_hits", "KV tier: blocks found below the device pool.", ("tier",))
        self.tier_misses = counter("rivulet:kv_tier_misses",
                                   "KV tier: lookups below the device pool that ended before the prompt's last block.")
        self.tier_bytes = counter("rivulet:kv_tier_bytes", "KV tier: bytes copied, by direction and tier.",
                                  ("direction", "tier"))
        self.tier_load_failures = counter("rivulet:kv_tier_load_failures",
                                          "KV tier: blocks whose load failed (missing or bad file): computed instead.")
        self.tier_loads = counter("rivulet:kv_tier_loads", "KV tier: loads completed (one per admission).")
        self.tier_load_seconds = counter("rivulet:kv_tier_load_seconds",
                                         "KV tier: total time from asking for a load to its report.")
        self.prompt_tokens = counter("rivulet:prompt_tokens", "Prompt tokens of requests served.")
        self.generation_tokens = counter("rivulet:generation_tokens", "Tokens generated.")
        self.request_success = counter("rivulet:request_success", "Finished choices by finish reason.",
                                       ("finished_reason",))
        self.rejected = counter("rivulet:requests_rejected", "Requests answered 503 without reaching the engine.",
                                ("reason",))
        self.ttft = histogram("rivulet:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("rivulet:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TOKEN_LATENCY_BUCKETS)
        self.itl = histogram("rivulet:inter_token_latency_seconds",
                             "Time between successive outputs of a request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("rivulet:e2e_request_latency_seconds", "Arrival to last output.",
                             REQUEST_LATENCY_BUCKETS)
        self.stage_seconds = Histogram("rivulet:pipeline_stage_seconds",
                                       "Pipelines: time in each stage's input step, by outcome (ok, skipped, failed, "
                                       "rejected, answered).", ["pipeline", "stage", "outcome"],
                                       buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.queue_time = histogram("rivulet:request_queue_time_seconds",
                                    "Arrival to first scheduling (approximated, see RequestTracker).",
                                    REQUEST_LATENCY_BUCKETS)

    def update_engine_stats(self, stats: dict[str, Any]) -> None:
        """Copy a ``get_stats()`` snapshot into the gauges; advance counters by what grew since the last one."""
        m = self.model_name
        self.running.labels(m).set(stats.get("num_running", 0))
        self.waiting.labels(m).set(stats.get("num_waiting", 0))
        self.kv_usage.labels(m).set(stats.get("kv_cache_usage", 0.0))
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        self.prefix_hit_rate.labels(m).set(hits / queries if queries else 0.0)
        for key, metric in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                            ("num_preemptions", self.preemptions)):
            value = float(stats.get(key, 0))
            grown = value - self._last_engine.get(key, 0.0)
            if grown > 0:
                metric.labels(m).inc(grown)
            self._last_engine[key] = max(value, self._last_engine.get(key, 0.0))
        if "kv_tier_loads" in stats:  # the engine has a KV tier
            size = float(stats.get("kv_tier_block_bytes", 0))
            self._advance([
                ("kv_tier_host_hits", self.tier_hits.labels(m, "host"), stats["kv_tier_host_hits"]),
                ("kv_tier_disk_hits", self.tier_hits.labels(m, "disk"), stats["kv_tier_disk_hits"]),
                ("kv_tier_misses", self.tier_misses.labels(m), stats["kv_tier_misses"]),
                ("kv_tier_saved_host", self.tier_bytes.labels(m, "save", "host"), stats["kv_tier_saved_host"] * size),
                ("kv_tier_saved_disk", self.tier_bytes.labels(m, "save", "disk"), stats["kv_tier_saved_disk"] * size),
                ("kv_tier_loaded_host", self.tier_bytes.labels(m, "load", "host"), stats["kv_tier_loaded_host"] * size),
                ("kv_tier_loaded_disk", self.tier_bytes.labels(m, "load", "disk"), stats["kv_tier_loaded_disk"] * size),
                ("kv_tier_load_failures", self.tier_load_failures.labels(m), stats["kv_tier_load_failures"]),
                ("kv_tier_loads", self.tier_loads.labels(m), stats["kv_tier_loads"]),
                ("kv_tier_load_seconds", self.tier_load_seconds.labels(m), stats["kv_tier_load_seconds"]),
            ])
        if "spec_decode_num_drafts" in stats:  # the engine speculates
            series = [("spec_decode_num_drafts", self.spec_drafts.labels(m), stats["spec_decode_num_drafts"]),
                      ("spec_decode_num_draft_tokens", self.spec_draft_tokens.labels(m),
                       stats.get("spec_decode_num_draft_tokens", 0)),
                      ("spec_decode_num_accepted_tokens", self.spec_accepted.labels(m),
                       stats.get("spec_decode_num_accepted_tokens", 0))]
            series += [(f"spec_decode_accepted_pos_{j}", self.spec_accepted_per_pos.labels(m, str(j)), v)
                       for j, v in enumerate(stats.get("spec_decode_accepted_per_pos", []))]
            self._advance(series)

    def _advance(self, series: list[tuple[str, Any, float]]) -> None:
        """Move each counter child up by what its cumulative engine value grew since the last snapshot."""
        for key, child, value in series:
            grown = float(value) - self._last_engine.get(key, 0.0)
            if grown > 0:
                child.inc(grown)
            self._last_engine[key] = max(float(value), self._last_engine.get(key, 0.0))

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def tracker(self) -> RequestTracker:
        """A tracker for one engine request, started now (its arrival)."""
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Latencies and token counts of one engine request, fed with its output snapshots.

    Queue time is approximated: the engine does not report when it first scheduled a request, so
    it is taken as the time to first token minus one step (the gap to the second output, an
    estimate of how long the prefill step took), at least 0. Requests that finish after one output
    count their whole time to first token as queue time.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.first_gap: float | None = None
        self.seen_tokens = 0
        self.done = False

    def observe(self, out: RequestOutput | PoolingRequestOutput) -> None:
        """Record one snapshot: new tokens, first-token and inter-token latencies, finish."""
        if self.done:
            return
        m, name = self.metrics, self.metrics.model_name
        now = time.monotonic()
        if isinstance(out, PoolingRequestOutput):  # an embedding: one output, at the end, no tokens generated
            if out.finished:
                m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                self.finish(["error" if out.error else "stop"], 0)
            return
        total = sum(len(o.token_ids) for o in out.outputs)
        new = total - self.seen_tokens
        if new > 0:
            if self.first is None:
                self.first = now
                m.ttft.labels(name).observe(now - self.arrival)
                m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
            else:
                gap = now - (self.last or now)
                m.itl.labels(name).observe(gap)
                if self.first_gap is None:
                    self.first_gap = gap
            m.generation_tokens.labels(name).inc(new)
            self.seen_tokens = total
            self.last = now
        if out.finished:
            self.finish([o.finish_reason or "abort" for o in out.outputs], max(len(o.token_ids) for o in out.outputs))

    def finish(self, reasons: list[str], longest: int) -> None:
        """Record the end of the request (once): finish reasons, e2e, TPOT and queue time."""
        if self.done:
            return
        self.done = True
        m, name = self.metrics, self.metrics.model_name
        now = time.monotonic()
        for reason in reasons:
            m.request_success.labels(name, reason).inc()
        m.e2e.labels(name).observe(now - self.arrival)
        if self.first is not None:
            ttft = self.first - self.arrival
            m.queue_time.labels(name).observe(max(0.0, ttft - (self.first_gap or 0.0)))
            if longest > 1 and self.last is not None:
                m.tpot.labels(name).observe((self.last - self.first) / (longest - 1))

    def abort(self, num_choices: int, reason: str = "abort") -> None:
        """The request ended without finishing: ``abort`` (client gone) or ``error`` (engine died)."""
        self.finish([reason] * num_choices, 0)
