"""The OpenAI-compatible server: the FastAPI app behind its gate (`gate.py`: API key, draining, body size,
in-flight count), and ``serve`` (wait for the engine `launch.run_server` spawned, serve, drain on SIGTERM).

Endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings`` (a model
served with ``--task embed``), ``/tokenize``, ``/detokenize``, ``/health`` (``?generate=1``: a one-token
generation, or embedding), ``/health_generate``, ``/version``,
``/metrics``; with ``--enable-lora`` also ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (an
adapter is then a model: ``"model": "<adapter name>"``). With ``--api-key`` every endpoint but
``/health``, ``/version``, ``/metrics`` and the OpenAPI docs needs ``Authorization: Bearer KEY``.

Overload: with ``--max-queue Q`` a generation request is answered 503 (``Retry-After``) without
reaching the engine when it would take the number of unfinished requests above
``--max-num-seqs + Q`` (running capacity plus Q waiting). A request with k prompts counts k.

Shutdown: on SIGTERM (or SIGINT) the server stops taking requests (they get 503), waits up to
``--drain-timeout`` seconds for the requests in flight, then closes the remaining connections
(aborting their engine requests), stops the engine process and exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

import rivulet
from rivulet.entrypoints.openai.engine_client import EngineClient
from rivulet.entrypoints.openai.errors import JSONBody, OpenAIError, error_response, install_exception_handlers
from rivulet.entrypoints.openai.gate import Gate
from rivulet.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                 CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                                 EmbeddingRequest, EmbeddingResponse, LoadModelRequest, ModelCard,
                                                 LoadLoRAAdapterRequest, ModelList, TokenizeRequest, TokenizeResponse,
                                                 UnloadLoRAAdapterRequest)
from rivulet.entrypoints.openai.deployment import Deployment, ModelSpec, ServedModel, model_settings
from rivulet.entrypoints.openai.launch import ServerSettings
from rivulet.entrypoints.openai.metrics import ServerMetrics
from rivulet.entrypoints.pipelines.pipeline import Pipeline
from rivulet.entrypoints.openai.serving_base import ServerContext
from rivulet.entrypoints.openai.streaming import EventStreamResponse
from rivulet.entrypoints.openai.tracing import REQUEST_SPAN, Attr, Tracer
from rivulet.entrypoints.openai.serving_chat import ChatHandler
from rivulet.entrypoints.openai.serving_completion import CompletionHandler
from rivulet.entrypoints.openai.serving_embedding import EmbeddingHandler
from rivulet.entrypoints.openai.serving_tokenization import TokenizationHandler
from rivulet.pooling_params import PoolingParams
from rivulet.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rivulet.entrypoints.openai.supervisor import SupervisedEngine

logger = logging.getLogger("rivulet.server")

STATS_TIMEOUT_S = 2.0
HEALTH_GENERATE_TIMEOUT_S = 30.0


@dataclass
class Handlers:
    """One model's endpoint handlers (all over its ServerContext)."""

    completions: CompletionHandler
    chat: ChatHandler
    tokens: TokenizationHandler
    embeddings: EmbeddingHandler

    @classmethod
    def of(cls, ctx: ServerContext) -> Handlers:
        return cls(CompletionHandler(ctx), ChatHandler(ctx), TokenizationHandler(ctx), EmbeddingHandler(ctx))


def build_app(engine: EngineClient | Deployment, settings: ServerSettings, tracer: Tracer | None = None) -> FastAPI:
    """The app for one engine (its state hangs off ``app.state.ctx``) or for a deployment of several models
    (``app.state.deployment``; ``app.state.ctx`` is then the first model's, which also counts the app's requests
    in flight and whether it drains)."""
    first_metrics: list[ServerMetrics] = []
    if tracer is None and settings.otlp_traces_endpoint:
        tracer = Tracer(settings.otlp_traces_endpoint)

    def make_served(spec: ModelSpec, model_engine: EngineClient, model_settings: ServerSettings) -> ServedModel:
        metrics = ServerMetrics(spec.name, like=first_metrics[0] if first_metrics else None)
        first_metrics.append(metrics)
        ctx = ServerContext(model_engine, model_settings, metrics, tracer)
        return ServedModel(spec, model_engine, ctx, Handlers.of(ctx))

    if isinstance(engine, Deployment):
        deployment = engine
        deployment.attach(lambda spec, e: make_served(spec, e, model_settings(settings, spec, spec.engine_config())))
    else:
        names = settings.served_model_names
        deployment = Deployment(make_served=lambda spec, e: make_served(spec, e, settings))
        deployment.add(ModelSpec(names[0], settings.model_root or names[0], tuple(names[1:])), engine, "ready")
    front = deployment.default.ctx
    for pipe in deployment.pipeline_specs:
        deployment.pipelines[pipe.name] = Pipeline(pipe, lambda name: route(name), tracer, front.metrics)
    app = FastAPI(title="Rivulet OpenAI-compatible API", version=rivulet.__version__)
    app.state.ctx, app.state.deployment, app.state.tracer = front, deployment, tracer
    install_exception_handlers(app)
    app.add_middleware(Gate, ctx=front)

    def route(requested: str | None) -> ServedModel:
        """The model a request names (the first model when it names none): 404 unknown, 503 still loading."""
        served = deployment.find(requested)
        if served is None or served.state == "unloading":
            raise OpenAIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        if served.state == "loading":
            raise OpenAIError(503, f"the model `{requested}` is still loading; retry later", code="model_loading",
                              headers={"Retry-After": "5"})
        return served

    def pipeline(requested: str | None, endpoint: str) -> Pipeline | None:
        """The pipeline a request names, if it names one (503 while its index is being built)."""
        pipe = deployment.pipelines.get(requested or "")
        if pipe is None:
            return None
        if endpoint not in ("chat", "completion"):
            raise OpenAIError(400, f"`{requested}` is a pipeline: it serves chat and completion requests",
                              param="model")
        if pipe.state != "ready":
            raise OpenAIError(503, f"the pipeline `{requested}` is still loading; retry later", code="model_loading",
                              headers={"Retry-After": "5"})
        return pipe

    async def traced(endpoint: str, model: str | None, call: Callable[[], Awaitable[Response]]) -> Response:
        """`call()`, within a trace span of this HTTP request when tracing is on (it ends with the response, a
        stream's when the stream does)."""
        if tracer is None:
            return await call()
        span = tracer.start("llm_request", {"http.route": endpoint, Attr.MODEL: model or deployment.default.spec.name})
        token = REQUEST_SPAN.set(span)
        try:
            response = await call()
        except BaseException as e:
            span.set_attribute("error.type", type(e).__name__)
            span.end()
            raise
        finally:
            REQUEST_SPAN.reset(token)
        span.set_attribute("http.response.status_code", response.status_code)
        if isinstance(response, EventStreamResponse):
            close = response.on_close

            async def close_and_end() -> None:
                try:
                    await close()
                finally:
                    span.end()
            response.on_close = close_and_end
        else:
            span.end()
        return response

    def serving() -> list[ServedModel]:
        return [m for m in deployment.models.values() if m.state == "ready"]

    @app.get("/health", responses={503: {"description": "an engine is not running (or, with generate=1, stuck)"}})
    async def health(generate: bool = False) -> Response:
        """200 while every model's engine runs, 503 while one is down or restarting; with ``generate=1`` (or at
        ``/health_generate``) 200 only once each has generated one token (or embedded one)."""
        for m in serving():
            if getattr(m.engine, "restarting", False):
                return error_response(OpenAIError(503, f"the engine of {m.spec.name} is restarting",
                                                  code="engine_restarting"))
            if not m.engine.is_healthy:
                return error_response(OpenAIError(503, f"the engine process of {m.spec.name} is not running",
                                                  code="engine_dead"))
        if generate:
            for m in serving():
                if (failed := await _generate_one_token(m.engine)) is not None:
                    return failed
        return Response(status_code=200)

    @app.get("/health_generate", responses={503: {"description": "an engine did not generate a token in time"}})
    async def health_generate() -> Response:
        return await health(generate=True)

    async def _generate_one_token(engine: EngineClient) -> Response | None:
        tok = engine.tokenizer
        first = getattr(tok, "bos_token_id", None) if tok is not None else None
        embed = engine.model_info.task == "embed"  # an embedding model: one embedding of one token
        params = PoolingParams() if embed else SamplingParams(max_tokens=1, temperature=0.0)
        stream = engine.generate({"prompt_token_ids": [first if first is not None else 0]}, params,
                                 f"health-{uuid.uuid4().hex}")

        async def drain() -> None:
            async for _ in stream:
                pass
        try:
            await asyncio.wait_for(drain(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(OpenAIError(503, f"the engine generated nothing in {HEALTH_GENERATE_TIMEOUT_S:.0f} s",
                                              code="engine_stuck"))
        except Exception as e:
            return error_response(OpenAIError(503, f"the engine could not generate: {e}", code="engine_dead"))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return None

    @app.get("/version")
    async def version() -> JSONBody:
        return JSONBody({"version": rivulet.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text; engine gauges refreshed from each engine that answers within 2 s."""
        async def refresh(m: ServedModel) -> None:
            if not m.engine.is_healthy:
                return
            # shielded: a slow engine step makes the scrape give up, not cancel the engine's pending reply
            stats = asyncio.ensure_future(m.engine.get_stats())
            stats.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception not retrieved"
            try:
                m.ctx.metrics.update_engine_stats(await asyncio.wait_for(asyncio.shield(stats), STATS_TIMEOUT_S))
            except Exception as e:  # a dead or slow engine must not break the scrape
                logger.debug("engine stats of %s unavailable: %s", m.spec.name, e)
        await asyncio.gather(*(refresh(m) for m in serving()))
        return Response(front.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str, served: ServedModel) -> ModelCard:
        ctx, info = served.ctx, served.engine.model_info if served.state == "ready" else None
        max_len = info.max_model_len if info is not None else None
        lora = ctx.lora_request(name)
        if lora is not None:  # an adapter: its folder, and the base model it adapts (as vLLM lists them)
            return ModelCard(id=name, root=lora.lora_path, parent=served.spec.name, max_model_len=max_len,
                             state=served.state, created=served.created)
        return ModelCard(id=name, root=ctx.settings.model_root, max_model_len=max_len, state=served.state,
                         task=info.task if info is not None else served.spec.task, created=served.created)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> JSONBody:
        cards = [model_card(n, m) for m in deployment.models.values() if m.state != "unloading"
                 for n in [*m.spec.names, *m.ctx.adapters]]
        cards += [ModelCard(id=p.name, state=p.state, task="pipeline", created=p.created,
                            parent=p.spec.generate.model) for p in deployment.pipelines.values()]
        return JSONBody(ModelList(data=cards).model_dump())

    @app.post("/v1/models/load", response_model=ModelCard)
    async def load_model(body: LoadModelRequest) -> JSONBody:
        if deployment.spawn is None:
            raise OpenAIError(400, "this server runs one engine; start it with --config to load models at run time")
        spec = ModelSpec.parse(body.model_dump(exclude_none=True), "the model to load")
        served = await deployment.load(spec)
        return JSONBody(model_card(spec.name, served).model_dump())

    @app.delete("/v1/models/{model:path}")
    async def unload_model(model: str) -> JSONBody:
        if deployment.spawn is None:
            raise OpenAIError(400, "this server runs one engine; start it with --config to unload models")
        try:
            await deployment.unload(model, settings.drain_timeout)
        except KeyError:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model",
                              code="model_not_found") from None
        return JSONBody({"id": model, "object": "model", "deleted": True})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        deployment.default.ctx.load_adapter(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        deployment.default.ctx.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/v1/models/{model:path}", response_model=ModelCard)
    async def get_model(model: str) -> JSONBody:
        served = deployment.find(model)
        if served is None or served.state == "unloading":
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return JSONBody(model_card(model, served).model_dump())

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": {"text/event-stream": {}}}})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        async def call() -> Response:
            if (pipe := pipeline(body.model, "completion")) is not None:
                return await pipe.create("completion", body, request)
            return await route(body.model).handlers.completions.create(body, request)
        return await traced("/v1/completions", body.model, call)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: {"content": {"text/event-stream": {}}}})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        async def call() -> Response:
            if (pipe := pipeline(body.model, "chat")) is not None:
                return await pipe.create("chat", body, request)
            return await route(body.model).handlers.chat.create(body, request)
        return await traced("/v1/chat/completions", body.model, call)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        pipeline(body.model, "embeddings")
        return await traced("/v1/embeddings", body.model,
                            lambda: route(body.model).handlers.embeddings.create(body, request))

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> JSONBody:
        pipeline(body.model, "tokenize")
        return JSONBody(route(body.model).handlers.tokens.tokenize(body).model_dump())

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> JSONBody:
        return JSONBody(route(body.model).handlers.tokens.detokenize(body).model_dump())

    return app


# ------------------------------------------------------------------------- the process

class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on the first SIGTERM/SIGINT instead of an immediate stop."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.loop = loop
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread): start draining; a second signal exits at once. The signal
        is not re-raised after shutdown, so the process exits 0."""
        if self.ctx.draining or self.should_exit:
            logger.info("second signal: stopping now")
            self.should_exit = self.force_exit = True
            return
        self.ctx.draining = True
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = self.loop.create_task(self._drain())

    async def _drain(self) -> None:
        timeout = self.ctx.settings.drain_timeout
        logger.info("shutting down: refusing new requests, waiting up to %.0f s for %d in flight", timeout,
                    self.ctx.inflight)
        deadline = time.monotonic() + timeout
        while self.ctx.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.ctx.inflight:
            logger.warning("drain timeout: closing %d requests still in flight", self.ctx.inflight)
        self.should_exit = True


async def serve(engine: SupervisedEngine | Deployment, settings: ServerSettings, sock: socket.socket,
                a: argparse.Namespace) -> int:
    """Build the app for a spawned engine (or a deployment's engines), wait for it, serve on `sock` until a
    signal has drained the requests (`launch.run_server` spawns the engines and shuts them down afterwards).
    Returns 1 when an engine could not be kept running (see `supervisor.py`), else 0."""
    app = build_app(engine, settings)
    deployment: Deployment = app.state.deployment
    uv_config = uvicorn.Config(app, log_level=a.uvicorn_log_level, access_log=not a.disable_uvicorn_access_log,
                               timeout_graceful_shutdown=2, timeout_keep_alive=5)
    started = min(getattr(m.engine, "spawned_at", time.monotonic()) for m in deployment.models.values())
    await deployment.ready()
    server = DrainingServer(uv_config, app.state.ctx, asyncio.get_running_loop())
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        server.should_exit = True

    for m in deployment.models.values():
        m.engine.on_fatal = on_fatal
    deployment.on_fatal = on_fatal  # models loaded later
    host, port = sock.getsockname()[:2]
    names = ", ".join(n for m in deployment.models.values() for n in m.spec.names)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1); the engines started in %.1f s",
                names, host, port, time.monotonic() - started)
    await server.serve(sockets=[sock])
    if app.state.tracer is not None:
        app.state.tracer.shutdown()  # the last spans go out
    logger.info("stopped")
    return 1 if fatal or any(getattr(m.engine, "fatal", None) for m in deployment.models.values()) else 0
