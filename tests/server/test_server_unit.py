"""The HTTP layer in-process, on a scripted fake engine: admission and overload, the gate (API key,
draining), engine death, JSON-safe logprobs, and the metrics' arithmetic."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import uvicorn

from fake_engine import FakeEngine
from rivulet.engine.outputs import CompletionOutput, RequestOutput
from rivulet.entrypoints.openai.api_server import DrainingServer, build_app
from rivulet.entrypoints.openai.metrics import ServerMetrics
from rivulet.entrypoints.openai.launch import ServerSettings, bind_socket
from rivulet.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from rivulet.engine.tokenizer import load_tokenizer
    from rivulet.models.loader import resolve_model

    return load_tokenizer(resolve_model("default"))


def _app(engine: FakeEngine, **settings: Any) -> Any:
    return build_app(engine, ServerSettings(served_model_names=["fake"], **settings))


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)


def _events(text: str) -> list[Any]:
    return [d if (d := line[6:]) == "[DONE]" else json.loads(d) for line in text.splitlines()
            if line.startswith("data: ")]


def test_overload_503_uses_counters_and_slots_come_back(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, script=[504, 3575], step_delay=0.05)
    app = _app(engine, max_queue=1, max_num_seqs=1)  # at most 2 unfinished requests

    async def main() -> None:
        async with _client(app) as c:
            slow = [asyncio.create_task(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 10}))
                    for _ in range(2)]
            while engine.num_unfinished_requests < 2:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/completions", json={"prompt": "b", "max_tokens": 1})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
            assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
            assert app.state.ctx.active == 0
            # a batch counts one slot per prompt: 3 prompts never fit under a limit of 2
            r = await c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1})
            assert r.status_code == 503
            r = await c.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
            assert r.status_code == 200 and [ch["index"] for ch in r.json()["choices"]] == [0, 1]
            # invalid input gives its slot back too
            r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 10_000})
            assert r.status_code == 400 and app.state.ctx.active == 0

    asyncio.run(main())
    assert engine.aborted == []


def test_gate_api_key_and_draining(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, script=[504])
    app = _app(engine, api_key="k")

    async def main() -> None:
        async with _client(app) as c:
            assert (await c.get("/v1/models")).status_code == 401
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer k"})).status_code == 200
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer kk"})).status_code == 401
            assert (await c.post("/detokenize", json={"tokens": [1]})).status_code == 401
            for path in ("/health", "/metrics", "/version", "/openapi.json"):
                assert (await c.get(path)).status_code == 200, path
            app.state.ctx.draining = True
            for path in ("/health", "/v1/models"):
                r = await c.get(path, headers={"Authorization": "Bearer k"})
                assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"

    asyncio.run(main())


def test_engine_death_ends_streams_with_an_error_event(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, script=[504, 3575, 282], step_delay=0.02)
    app = _app(engine)

    async def main() -> None:
        async with _client(app) as c:
            asyncio.get_running_loop().call_later(0.15, engine.kill)
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 200, "stream": True})
            events = _events(r.text)
            assert r.status_code == 200 and "[DONE]" not in events
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[-1]["error"]["code"] == "engine_dead"
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert (await c.get("/health")).status_code == 503
            metrics = (await c.get("/metrics")).text
            # the stream cut by the death and the request refused after it
            assert 'rivulet:request_success_total{finished_reason="error",model_name="fake"} 2.0' in metrics

    asyncio.run(main())
    assert app.state.ctx.active == 0


def test_request_timeout_answers_408_or_ends_the_stream_and_aborts(tokenizer: Any) -> None:
    """--request-timeout: a request not done in time is aborted in the engine (its slot back) and answered 408,
    or, streamed, gets the 408 as its last event before [DONE]; a request done in time is untouched."""
    engine = FakeEngine(tokenizer, script=[504], step_delay=0.05)  # 100 tokens: 5 s
    app = _app(engine, request_timeout=0.6)

    async def main() -> None:
        async with _client(app) as c:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 100})
            assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
            assert "0.6 s" in r.json()["error"]["message"] and time.monotonic() - t0 < 3
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 100, "stream": True})
            events = _events(r.text)
            assert r.status_code == 200 and events[-1] == "[DONE]" and len(events) >= 4  # tokens came first
            assert events[-2]["error"]["code"] == "request_timeout" and "choices" in events[-3]
            r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            assert app.state.ctx.active == 0

    asyncio.run(main())
    assert len(engine.aborted) == 2 and engine.num_unfinished_requests == 0


def test_logprobs_are_json_safe_and_shaped(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, script=[504, 3575])
    app = _app(engine)

    async def main() -> None:
        async with _client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "x y", "max_tokens": 2, "logprobs": 1,
                                                      "echo": True})
            lp = r.json()["choices"][0]["logprobs"]
            assert lp["token_logprobs"][0] is None and lp["token_logprobs"][-2:] == [-0.5, -0.5]
            assert lp["text_offset"] == sorted(lp["text_offset"])
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
            content = r.json()["choices"][0]["logprobs"]["content"]
            assert [t["logprob"] for t in content] == [-0.5, -0.5]
            assert [t["top_logprobs"][1]["logprob"] for t in content] == [-9999.0, -9999.0]  # -inf, clamped

    asyncio.run(main())


def test_request_tracker_arithmetic() -> None:
    metrics = ServerMetrics("m")
    tracker = metrics.tracker()
    out = RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(0), CompletionOutput(1)])
    for step in range(3):
        for c in out.outputs:
            c.token_ids.append(7)
            if step == 2:
                c.finish_reason = "stop" if c.index == 0 else "length"
        tracker.observe(out)
    tracker.observe(out)  # repeated snapshots after the end change nothing
    text = metrics.render().decode()

    def value(name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value('rivulet:prompt_tokens_total{model_name="m"}') == 3
    assert value('rivulet:generation_tokens_total{model_name="m"}') == 6
    assert value('rivulet:request_success_total{finished_reason="stop",model_name="m"}') == 1
    assert value('rivulet:request_success_total{finished_reason="length",model_name="m"}') == 1
    assert value('rivulet:time_to_first_token_seconds_count{model_name="m"}') == 1
    assert value('rivulet:inter_token_latency_seconds_count{model_name="m"}') == 2
    for name in ("time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert value(f'rivulet:{name}_count{{model_name="m"}}') == 1
    metrics.update_engine_stats({"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5,
                                 "prefix_cache_queries": 10, "prefix_cache_hits": 4, "num_preemptions": 3})
    metrics.update_engine_stats({"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
                                 "prefix_cache_queries": 20, "prefix_cache_hits": 4, "num_preemptions": 3})
    text = metrics.render().decode()
    assert value('rivulet:prefix_cache_queries_total{model_name="m"}') == 20
    assert value('rivulet:num_preemptions_total{model_name="m"}') == 3
    assert value('rivulet:prefix_cache_hit_rate{model_name="m"}') == pytest.approx(0.2)
    assert value('rivulet:num_requests_running{model_name="m"}') == 0
    assert 'spec_decode_num_drafts_total{' not in text  # only an engine that speculates has the series
    spec = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 5,
            "spec_decode_accepted_per_pos": [3, 2]}
    metrics.update_engine_stats(spec)
    metrics.update_engine_stats(spec | {"spec_decode_num_drafts": 6, "spec_decode_accepted_per_pos": [4, 2, 1]})
    text = metrics.render().decode()
    assert value('rivulet:spec_decode_num_drafts_total{model_name="m"}') == 6
    assert value('rivulet:spec_decode_num_draft_tokens_total{model_name="m"}') == 12
    assert value('rivulet:spec_decode_num_accepted_tokens_total{model_name="m"}') == 5
    assert [value(f'rivulet:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{j}"}}')
            for j in range(3)] == [4, 2, 1]
    assert "kv_tier_loads_total{" not in text  # only an engine with a KV tier has its series
    tier = {"kv_tier_host_hits": 3, "kv_tier_disk_hits": 5, "kv_tier_misses": 2, "kv_tier_saved_host": 10,
            "kv_tier_saved_disk": 7, "kv_tier_loaded_host": 3, "kv_tier_loaded_disk": 4, "kv_tier_load_failures": 1,
            "kv_tier_loads": 2, "kv_tier_load_seconds": 0.25, "kv_tier_block_bytes": 1000}
    metrics.update_engine_stats(tier)
    metrics.update_engine_stats(tier | {"kv_tier_loaded_disk": 6, "kv_tier_loads": 3})
    text = metrics.render().decode()
    assert value('rivulet:kv_tier_hits_total{model_name="m",tier="disk"}') == 5
    assert value('rivulet:kv_tier_misses_total{model_name="m"}') == 2
    assert value('rivulet:kv_tier_bytes_total{direction="load",model_name="m",tier="disk"}') == 6000
    assert value('rivulet:kv_tier_bytes_total{direction="save",model_name="m",tier="host"}') == 10000
    assert value('rivulet:kv_tier_loads_total{model_name="m"}') == 3
    assert value('rivulet:kv_tier_load_seconds_total{model_name="m"}') == 0.25
    assert value('rivulet:kv_tier_load_failures_total{model_name="m"}') == 1


def test_drain_finishes_short_requests_and_cuts_long_ones_at_the_timeout(tokenizer: Any) -> None:
    """SIGTERM handling in-process: the in-flight short stream completes, the long one is closed when
    the drain timeout passes (and aborted in the engine), new requests get 503, serve() returns."""
    engine = FakeEngine(tokenizer, script=[504, 3575], step_delay=0.05)
    app = _app(engine, drain_timeout=1.0)
    sock = bind_socket("127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]

    async def stream(c: httpx.AsyncClient, max_tokens: int) -> list[Any] | str:
        try:
            async with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": max_tokens,
                                                                 "stream": True}) as r:
                return _events("\n".join([line async for line in r.aiter_lines()]))
        except httpx.HTTPError as e:
            return type(e).__name__

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1),
                                app.state.ctx, loop)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            while True:
                try:
                    if (await c.get("/health")).status_code == 200:
                        break
                except httpx.ConnectError:
                    pass
                await asyncio.sleep(0.05)
            short, long = asyncio.create_task(stream(c, 10)), asyncio.create_task(stream(c, 200))
            while engine.num_unfinished_requests < 2:
                await asyncio.sleep(0.01)
            server.handle_exit(signal.SIGTERM, None)
            await asyncio.sleep(0.1)
            r = await c.get("/v1/models")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            short_events, long_events = await short, await long
        await asyncio.wait_for(serving, 10)
        assert isinstance(short_events, list) and short_events[-1] == "[DONE]"
        # the long stream was cut mid-way: closed under the client, or ended with tokens but no [DONE]
        assert long_events == "RemoteProtocolError" or (
            isinstance(long_events, list) and long_events and "[DONE]" not in long_events), long_events

    asyncio.run(main())
    assert len(engine.aborted) == 1 and engine.num_unfinished_requests == 0
    assert app.state.ctx.active == 0


def test_serve_reports_a_busy_port_in_one_line_before_loading() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "rivulet.entrypoints.cli", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"rivulet: error: cannot listen on 127.0.0.1:{port}")
    assert time.monotonic() - t0 < 30  # no model was loaded


def test_api_server_process_starts_without_torch_or_transformers() -> None:
    """The front end spawns the engine right after its imports: torch (~1.5 s) and transformers (~1 s)
    stay out of that path (transformers comes with the tokenizer, in a thread, while the engine loads)."""
    code = ("import sys, rivulet.entrypoints.openai.api_server, rivulet.engine.async_llm, rivulet.engine.messages; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_serve_spawns_the_engine_before_importing_the_web_framework() -> None:
    """`launch` (flags, port, engine spawn) imports neither FastAPI nor torch: the engine's load starts
    before the front end's ~1 s of web-framework imports, which then run beside it."""
    code = ("import sys, rivulet.entrypoints.cli, rivulet.entrypoints.openai.launch, rivulet.engine.async_llm; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reasoning_parser_starts_grammars_after_the_thinking(tokenizer: Any) -> None:
    """With --reasoning-parser, a grammar (response_format, tools) waits for "</think>"; not when the
    template's thinking is switched off, nor without a reasoning parser."""
    seen: list[SamplingParams] = []

    class Recording(FakeEngine):
        def generate(self, prompt: Any, params: SamplingParams, request_id: str, priority: int = 0, lora_request=None):
            seen.append(params)
            return super().generate(prompt, params, request_id, priority, lora_request)

    end = list(tokenizer("</think>", add_special_tokens=False).input_ids)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {"type": "json_object"}}
    for settings, extra, want in [({"reasoning_parser": "qwen3"}, {}, end),
                                  ({"reasoning_parser": "qwen3"}, {"chat_template_kwargs": {"enable_thinking": False}},
                                   None),
                                  ({}, {}, None)]:
        app = _app(Recording(tokenizer, script=[504]), **settings)

        async def main() -> None:
            async with _client(app) as c:
                r = await c.post("/v1/chat/completions", json=body | extra)
                assert r.status_code == 200, r.text

        asyncio.run(main())
        assert seen[-1].structured_outputs is not None and seen[-1].structured_outputs.after_token_ids == want


def test_data_parallel_replica_configs_and_merged_stats() -> None:
    from rivulet.engine.args import EngineArgs
    from rivulet.entrypoints.openai.data_parallel import merge_stats, replica_configs

    config = EngineArgs(data_parallel_size=2).create_engine_config()
    two = replica_configs(config, 2, [0, 1, 2, 3])
    assert [c.parallel.cpus for c in two] == [[0, 1], [2, 3]]
    assert all(c.parallel.data_parallel_size == 1 for c in two)  # each replica is one engine
    assert [c.parallel.cpus for c in replica_configs(config, 3, [0, 1])] == [[0, 1]] * 3  # fewer cores: share all
    merged = merge_stats([{"num_running": 2, "kv_cache_usage": 0.5, "kv_tier_block_bytes": 10, "model": "m"},
                          {"num_running": 3, "kv_cache_usage": 0.1, "kv_tier_block_bytes": 10, "model": "m"}])
    assert merged == {"num_running": 5, "kv_cache_usage": 0.3, "kv_tier_block_bytes": 10, "model": "m"}


def _adapter(folder: Any, rank: int = 4) -> str:
    """A PEFT-format adapter folder (q_proj of layer 0) written by hand: what the server checks."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                            "target_modules": ["q_proj"]}))
    p = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{p}.lora_A.weight": np.zeros((rank, 8), np.float32),
               f"{p}.lora_B.weight": np.zeros((8, rank), np.float32)}, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_lora_adapters_are_models_loaded_and_unloaded_at_run_time(tokenizer: Any, tmp_path: Any) -> None:
    """--lora-modules and /v1/load_lora_adapter make adapters models (listed with their base as parent);
    a request naming one reaches the engine with its LoRARequest; unloading makes the name unknown."""
    engine = FakeEngine(tokenizer, script=[504])
    app = _app(engine, max_lora_rank=8, lora_modules={"sql": _adapter(tmp_path / "sql")})
    second, too_big = _adapter(tmp_path / "chat"), _adapter(tmp_path / "big", rank=16)

    async def main() -> None:
        async with _client(app) as c:
            cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
            assert cards["sql"]["parent"] == "fake" and cards["sql"]["root"] == str(tmp_path / "sql")
            r = await c.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "sql"
            assert engine.last_lora.lora_name == "sql" and engine.last_lora.lora_path == str(tmp_path / "sql")
            await c.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 1})
            assert engine.last_lora is None
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": second})
            assert r.status_code == 200 and "added successfully" in r.text
            r = await c.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and engine.last_lora.lora_name == "chat"
            assert engine.last_lora.lora_int_id != app.state.ctx.adapters["sql"].lora_int_id
            for body, status, msg in [({"lora_name": "chat", "lora_path": second}, 400, "already been loaded"),
                                      ({"lora_name": "fake", "lora_path": second}, 400, "already been loaded"),
                                      ({"lora_name": "big", "lora_path": too_big}, 400, "more than --max-lora-rank 8"),
                                      ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "adapter_config.json"),
                                      ({"lora_name": "x"}, 400, "lora_path")]:
                r = await c.post("/v1/load_lora_adapter", json=body)
                assert r.status_code == status and msg in r.json()["error"]["message"], (body, r.text)
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
            assert r.status_code == 200 and "removed successfully" in r.text
            r = await c.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
            assert r.status_code == 404
            assert "chat" not in {m["id"] for m in (await c.get("/v1/models")).json()["data"]}

    asyncio.run(main())
    off = _app(FakeEngine(tokenizer, script=[504]))

    async def without_lora() -> None:
        async with _client(off) as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": second})
            assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]

    asyncio.run(without_lora())


def test_lora_modules_flag_forms_and_errors(tmp_path: Any) -> None:
    from rivulet.config import RivuletError
    from rivulet.entrypoints.openai.launch import parse_lora_modules

    a, b = _adapter(tmp_path / "a"), _adapter(tmp_path / "b")
    assert parse_lora_modules([f"x={a}", json.dumps({"name": "y", "path": b})], 8) == {"x": a, "y": b}
    for specs, rank, msg in [([f"x={a}"], None, "needs --enable-lora"), (["x"], 8, "is not name=path"),
                             ([f"x={a}", f"x={b}"], 8, "given twice"), (["{\"name\": 1}"], 8, "is not JSON"),
                             ([f"x={a}"], 2, "more than --max-lora-rank 2")]:
        with pytest.raises(RivuletError, match=msg):
            parse_lora_modules(specs, rank)


def test_until_disconnected_tells_a_leaving_client_from_an_internal_cancellation() -> None:
    from rivulet.entrypoints.openai.errors import OpenAIError
    from rivulet.entrypoints.openai.aio import ClientDisconnected, until_disconnected

    async def stays() -> dict:
        await asyncio.sleep(3600)
        return {}

    async def leaves() -> dict:
        return {"type": "http.disconnect"}

    async def cancelled_inside() -> int:
        raise asyncio.CancelledError("a future inside the server was cancelled")

    async def main() -> None:
        assert await until_disconnected(stays, asyncio.sleep(0, 7)) == 7
        with pytest.raises(ClientDisconnected):
            await until_disconnected(leaves, asyncio.sleep(3600))
        with pytest.raises(OpenAIError) as e:  # not a 499 for a client that is still waiting
            await until_disconnected(stays, cancelled_inside())
        assert e.value.status == 500

    asyncio.run(main())
