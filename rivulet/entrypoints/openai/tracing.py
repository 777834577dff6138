"""OpenTelemetry traces of requests (``--otlp-traces-endpoint URL``, OTLP over HTTP/protobuf; off by default).

One span per HTTP request (``llm_request``), with children: one per pipeline stage (``stage <name>``) and,
for each engine request it made, its phases as the engine saw them: ``queue`` (arrival to first scheduled),
``prefill`` (to the first token, or to the embedding) and ``decode`` (to the last token). Attributes follow
vLLM's ``gen_ai.*`` names. The API server creates spans with explicit times once a request ends; the engine
only reports when it first scheduled each request (``RequestOutput.first_scheduled_time``).
"""

from __future__ import annotations

import contextvars
import time
from typing import Any

# the current HTTP request's span, for the request groups and pipeline stages the handler runs
REQUEST_SPAN: contextvars.ContextVar[Any] = contextvars.ContextVar("rivulet_request_span", default=None)


class Attr:
    """vLLM's span attribute names."""

    REQUEST_ID = "gen_ai.request.id"
    MODEL = "gen_ai.response.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    N = "gen_ai.request.n"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    QUEUE = "gen_ai.latency.time_in_queue"
    TTFT = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    FINISH = "gen_ai.response.finish_reasons"


class Tracer:
    def __init__(self, endpoint: str | None = None, exporter: Any = None, service_name: str = "rivulet") -> None:
        """Spans go to the OTLP/HTTP collector at `endpoint` (e.g. http://127.0.0.1:4318/v1/traces), or to
        `exporter` (a SpanExporter, e.g. the SDK's in-memory one)."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install opentelemetry-sdk==1.45.2 "
                             "opentelemetry-exporter-otlp-proto-http==1.45.2 (or rivulet[tracing])") from None
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
        self.tracer = self.provider.get_tracer("rivulet")

    def start(self, name: str, attributes: dict[str, Any] | None = None) -> Any:
        return self.tracer.start_span(name, attributes=_clean(attributes or {}))

    def child(self, parent: Any, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None) -> None:
        from opentelemetry import trace

        span = self.tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns,
                                      attributes=_clean(attributes or {}))
        span.end(end_time=max(end_ns, start_ns))

    def engine_request(self, parent: Any, request_id: str, arrival_ns: int, first_ns: int | None, end_ns: int,
                       out: Any, params: Any) -> None:
        """The queue, prefill and decode spans of one engine request (times as it ran), and its attributes."""
        scheduled = getattr(out, "first_scheduled_time", None) if out is not None else None
        sched_ns = min(max(int(scheduled * 1e9), arrival_ns), end_ns) if scheduled else None
        base = {Attr.REQUEST_ID: request_id}
        if sched_ns is not None:
            self.child(parent, "queue", arrival_ns, sched_ns, base)
            self.child(parent, "prefill", sched_ns, first_ns or end_ns, base)
        if first_ns is not None and getattr(out, "outputs", None) and isinstance(out.outputs, list):
            tokens = sum(len(c.token_ids) for c in out.outputs)
            self.child(parent, "decode", first_ns, end_ns, {**base, Attr.COMPLETION_TOKENS: tokens})
        if out is None:
            return
        attrs = {Attr.PROMPT_TOKENS: len(out.prompt_token_ids), Attr.E2E: (end_ns - arrival_ns) / 1e9}
        if isinstance(out.outputs, list):
            attrs[Attr.COMPLETION_TOKENS] = sum(len(c.token_ids) for c in out.outputs)
            attrs[Attr.FINISH] = [c.finish_reason or "abort" for c in out.outputs]
        if sched_ns is not None:
            attrs[Attr.QUEUE] = (sched_ns - arrival_ns) / 1e9
        if first_ns is not None:
            attrs[Attr.TTFT] = (first_ns - arrival_ns) / 1e9
        if params is not None and hasattr(params, "temperature"):
            attrs |= {Attr.MAX_TOKENS: params.max_tokens, Attr.TEMPERATURE: params.temperature,
                      Attr.TOP_P: params.top_p, Attr.N: params.n}
        for key, value in _clean(attrs).items():  # summed over the HTTP request's engine requests
            if isinstance(value, (int, float)) and key in (Attr.PROMPT_TOKENS, Attr.COMPLETION_TOKENS):
                value += parent.attributes.get(key, 0) if hasattr(parent, "attributes") else 0
            parent.set_attribute(key, value)

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what is queued


def now_ns() -> int:
    return time.time_ns()


def _clean(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None}
