"""OpenTelemetry traces: a real server sends its spans to a loopback OTLP/HTTP collector (one request span with
its engine phases, vLLM's gen_ai attributes); a pipeline's stages appear as children (the SDK's in-memory
exporter over fake engines)."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from server_helpers import ServerProcess

from rivulet.entrypoints.openai.api_server import build_app
from rivulet.entrypoints.openai.deployment import Deployment, DeploymentSpec
from rivulet.entrypoints.openai.launch import ServerSettings
from rivulet.entrypoints.openai.tracing import Tracer


class Collector(http.server.ThreadingHTTPServer):
    """OTLP/HTTP (protobuf) on loopback: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        collector.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    threading.Thread(target=c.serve_forever, daemon=True).start()
    yield c
    c.shutdown()


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = (v.int_value if v.HasField("int_value") else v.double_value if v.HasField("double_value")
                       else v.string_value if v.HasField("string_value") else [x.string_value for x in v.array_value.values])
    return out


def test_a_served_request_is_one_span_with_its_engine_phases(collector: Collector) -> None:
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    server = ServerProcess("--otlp-traces-endpoint", endpoint, "--served-model-name", "smol", "--max-model-len", "512")
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "smol", "prompt": "Once upon a time",
                                                             "max_tokens": 5, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(collector.spans) < 4:
            time.sleep(0.1)
    finally:
        server.stop()
    by_name = {s.name: s for s in collector.spans}
    assert {"llm_request", "queue", "prefill", "decode"} <= set(by_name)
    root = by_name["llm_request"]
    for name in ("queue", "prefill", "decode"):
        child = by_name[name]
        assert child.trace_id == root.trace_id and child.parent_span_id == root.span_id
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
    # the phases follow each other
    assert by_name["queue"].end_time_unix_nano == by_name["prefill"].start_time_unix_nano
    assert by_name["prefill"].end_time_unix_nano == by_name["decode"].start_time_unix_nano
    a = attrs(root)
    assert a["gen_ai.usage.completion_tokens"] == 5 and a["gen_ai.usage.prompt_tokens"] > 2
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.response.model"] == "smol"
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["http.response.status_code"] == 200 and a["gen_ai.response.finish_reasons"] == ["length"]


def test_pipeline_stages_are_children_of_the_request_span() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from fake_engine import FakeEngine

    from rivulet.engine.tokenizer import load_tokenizer
    from rivulet.models.loader import resolve_model

    tok = load_tokenizer(resolve_model("default"))

    class Ready(FakeEngine):
        async def ready(self) -> Ready:
            return self

    exporter = InMemorySpanExporter()
    tracer = Tracer(exporter=exporter)
    deployment = Deployment(spawn=lambda c: Ready(tok, script=[504], step_delay=0.001))
    deployment.start(DeploymentSpec.parse({"models": [{"name": "chat"}], "pipelines": [{"name": "p", "stages": [
        {"type": "redact", "patterns": ["secret"], "name": "scrub"},
        {"type": "template", "template": "Q: {{ input }}"},
        {"type": "generate", "model": "chat"}]}]}))
    app = build_app(deployment, ServerSettings(served_model_names=["x"]), tracer=tracer)

    async def main() -> None:
        await deployment.ready()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/chat/completions", json={"model": "p", "max_tokens": 2, "stream": True,
                                                           "messages": [{"role": "user", "content": "a secret"}]})
            assert r.status_code == 200
    asyncio.run(main())
    tracer.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["llm_request"]
    for name in ("stage scrub", "stage template", "stage generate"):
        assert spans[name].parent.span_id == root.context.span_id
        assert spans[name].attributes["rivulet.pipeline"] == "p"
        assert spans[name].attributes["rivulet.stage.outcome"] == "ok"
    assert root.end_time >= spans["stage generate"].end_time  # the stream ended the request span
    assert root.attributes["gen_ai.usage.completion_tokens"] == 2


def test_request_log_lines_are_json_without_text_unless_asked() -> None:
    import json as _json

    for flags, text in ((["--log-requests"], False), (["--log-requests", "--log-request-text"], True)):
        server = ServerProcess(*flags, "--served-model-name", "smol", "--max-model-len", "512")
        try:
            r = httpx.post(f"{server.url}/v1/completions", json={"model": "smol", "prompt": "Secret prompt words",
                                                                 "max_tokens": 3, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200
            time.sleep(0.3)
        finally:
            server.stop()
        lines = [_json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        [line] = [x for x in lines if x.get("request_id", "").startswith("cmpl-")]
        assert line["model"] == "smol" and line["completion_tokens"] == 3 and line["finish_reasons"] == ["length"]
        assert line["prompt_tokens"] > 2 and 0 <= line["queue_s"] <= line["ttft_s"] <= line["e2e_s"]
        assert ("Secret prompt words" in server.log()) == text
        if text:
            assert line["prompt"] == "Secret prompt words" and len(line["outputs"]) == 1
