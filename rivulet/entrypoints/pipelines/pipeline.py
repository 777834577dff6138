"""A pipeline: stages around one generation, served under a model name of its own through the chat and
completion endpoints. Input stages run in order on a copy of the request (each within its timeout; a failing
one fails the request or is skipped, as its `on_error` says); the generation runs on its model's handler
unchanged; each choice's text then passes the stages' output filters: in one piece for a JSON answer,
chunk by chunk for a stream (the filters hold back what could still become a match)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.responses import Response

from rivulet.entrypoints.openai.errors import JSONBody, OpenAIError
from rivulet.entrypoints.openai.streaming import SSE_DONE, EventStreamResponse, sse
from rivulet.entrypoints.openai.tracing import REQUEST_SPAN, now_ns
from rivulet.entrypoints.pipelines.filters import Chain
from rivulet.entrypoints.pipelines.stages import (GenerateStage, PipelineRequest, RetrieveStage, StageAnswered,
                                                  StageRejected, build_stage)

logger = logging.getLogger("rivulet.server")


@dataclass
class PipelineSpec:
    name: str
    stages: list[Any]

    @classmethod
    def parse(cls, d: Any, where: str) -> PipelineSpec:
        if not isinstance(d, dict) or set(d) - {"name", "stages"}:
            raise ValueError(f"{where}: a pipeline is a mapping with name and stages")
        name, stages = d.get("name"), d.get("stages")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: 'name' must be a non-empty string")
        if not isinstance(stages, list) or not stages:
            raise ValueError(f"{where} ({name}): 'stages' must be a non-empty list")
        built = [build_stage(s, f"{where} ({name}): stages[{i}]") for i, s in enumerate(stages)]
        generates = [s for s in built if isinstance(s, GenerateStage)]
        if len(generates) != 1:
            raise ValueError(f"{where} ({name}): a pipeline has exactly one generate stage")
        return cls(name, built)

    @property
    def generate(self) -> GenerateStage:
        return next(s for s in self.stages if isinstance(s, GenerateStage))

    def models(self) -> set[str]:
        return {m for s in self.stages for m in s.models()}


class Pipeline:
    """The running pipeline: `route(name)` finds a model of the deployment (its ServedModel: handlers, engine)."""

    def __init__(self, spec: PipelineSpec, route: Callable[[str | None], Any], tracer: Any = None,
                 metrics: Any = None) -> None:
        self.spec, self.name, self.route, self.tracer, self.metrics = spec, spec.name, route, tracer, metrics
        self.state = "loading"  # until its retrieval indexes are ready
        self.created = int(time.time())

    async def prepare(self) -> None:
        """Open (or build) the index of every retrieve stage, through its embedding model."""
        from rivulet.entrypoints.pipelines.retrieval import DocumentIndex
        from rivulet.pooling_params import PoolingParams

        for stage in self.spec.stages:
            if not isinstance(stage, RetrieveStage):
                continue
            engine = self.route(stage.embed_model).engine

            async def embed(texts: list[str], engine: Any = engine) -> list[list[float]]:
                async def one(text: str) -> list[float]:
                    out = None
                    rid = f"retrieve-{uuid.uuid4().hex}"
                    async for out in engine.generate(text, PoolingParams(truncate_prompt_tokens=-1), rid):
                        pass
                    if out is None or out.outputs is None:
                        raise RuntimeError(out.error if out is not None else "no embedding")
                    return out.outputs.embedding
                return list(await asyncio.gather(*(one(t) for t in texts)))

            stage.embed = embed
            stage.index = await DocumentIndex.open(stage.documents, stage.index_dir, stage.chunk_chars,
                                                   f"{stage.embed_model}:{engine.model_info.hidden_size}", embed)
        self.state = "ready"

    # ---- one request ----

    async def create(self, kind: str, body: Any, raw: Any) -> Response:
        """Answer a chat (`kind` "chat") or completion request sent to this pipeline."""
        req = PipelineRequest(kind, body.model_copy(deep=True))
        try:
            await self._run_input(req)
        except StageRejected as e:
            raise OpenAIError(400, str(e), code=e.code) from None
        except StageAnswered as e:
            return self._answer(req, e.text, e.finish_reason)
        target = self.route(req.model or self.spec.generate.model)
        req.body.model = target.spec.name
        handlers = target.handlers
        response = await (handlers.chat if kind == "chat" else handlers.completions).create(req.body, raw)
        filters = lambda: Chain([f for s in self.spec.stages if (f := s.output_filter(req)) is not None])  # noqa: E731
        if isinstance(response, EventStreamResponse):
            response.events = self._filter_stream(response.events, kind, filters)
            return response
        if isinstance(response, JSONBody) and response.status_code == 200:
            data = json.loads(response.body)
            data["model"] = self.name
            for choice in data.get("choices", []):
                chain = filters()
                _set_text(choice, kind, chain.apply(_text(choice, kind) or ""), stream=False)
                if chain.stopped:
                    choice["finish_reason"] = "content_filter"
            return JSONBody(data)
        return response

    async def _run_input(self, req: PipelineRequest) -> None:
        span = REQUEST_SPAN.get() if self.tracer is not None else None
        for stage in self.spec.stages:
            saved = (req.body.model_copy(deep=True), req.model, copy.copy(req.context))
            start = now_ns()
            outcome = "ok"
            try:
                work = stage.on_input(req)
                await (asyncio.wait_for(work, stage.timeout) if stage.timeout else work)
            except (StageRejected, StageAnswered) as e:
                outcome = "rejected" if isinstance(e, StageRejected) else "answered"
                raise
            except Exception as e:  # noqa: BLE001 - a stage's failure: its on_error decides
                why = f"timed out after {stage.timeout:g} s" if isinstance(e, asyncio.TimeoutError) \
                    else f"{type(e).__name__}: {e}"
                outcome = "skipped" if stage.on_error == "skip" else "failed"
                if stage.on_error == "skip":
                    logger.warning("pipeline %s: stage %s skipped: %s", self.name, stage.label, why)
                    req.body, req.model, req.context = saved
                    continue
                raise OpenAIError(500 if not isinstance(e, asyncio.TimeoutError) else 504,
                                  f"pipeline {self.name}: stage {stage.label} failed: {why}",
                                  code="stage_failed") from None
            finally:
                if self.metrics is not None:
                    self.metrics.stage_seconds.labels(self.name, stage.label, outcome).observe((now_ns() - start) / 1e9)
                if span is not None:
                    self.tracer.child(span, f"stage {stage.label}", start, now_ns(),
                                      {"rivulet.pipeline": self.name, "rivulet.stage.type": stage.kind,
                                       "rivulet.stage.outcome": outcome})

    async def _filter_stream(self, events: AsyncIterator[str], kind: str,
                             filters: Callable[[], Chain]) -> AsyncIterator[str]:
        chains: dict[int, Chain] = {}
        ended: set[int] = set()
        try:
            async for event in events:
                if not event.startswith("data: {"):
                    yield event
                    continue
                data = json.loads(event[6:])
                if "choices" not in data:  # an error event
                    yield event
                    continue
                data["model"] = self.name
                kept = []
                for choice in data["choices"]:
                    i = choice.get("index", 0)
                    if i in ended:
                        continue
                    chain = chains.setdefault(i, filters())
                    text = chain.feed(_text(choice, kind) or "")
                    if choice.get("finish_reason") is not None or chain.stopped:
                        text += chain.finish()
                    _set_text(choice, kind, text, stream=True)
                    if chain.stopped:
                        choice["finish_reason"] = "content_filter"
                    if choice.get("finish_reason") is not None:
                        ended.add(i)
                    kept.append(choice)
                if kept or not data["choices"]:  # (a usage chunk has no choices)
                    data["choices"] = kept
                    yield sse(data)
                if chains and ended >= set(chains) and any(c.stopped for c in chains.values()):
                    yield SSE_DONE  # every choice is over, one by a filter: the generation is cut short
                    return
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # aborts what the engine still runs

    def _answer(self, req: PipelineRequest, text: str, finish_reason: str) -> Response:
        """A reply made by a stage, in the shape the endpoint answers (JSON or a stream)."""
        kind, created = req.kind, int(time.time())
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if kind == "chat" else "text_completion"
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        if not getattr(req.body, "stream", False):
            choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
            _set_text(choice, kind, text, stream=False)
            return JSONBody({"id": rid, "object": obj, "created": created, "model": self.name, "choices": [choice],
                             "usage": usage})

        async def events() -> AsyncIterator[str]:
            chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
            _set_text(choice, kind, text, stream=True)
            yield sse({"id": rid, "object": chunk_obj, "created": created, "model": self.name, "choices": [choice]})
            yield SSE_DONE

        async def nothing() -> None:
            return None
        return EventStreamResponse(events(), on_close=nothing)


def _text(choice: dict[str, Any], kind: str) -> str | None:
    if kind == "completion":
        return choice.get("text")
    holder = choice.get("delta") if "delta" in choice else choice.get("message")
    return (holder or {}).get("content")


def _set_text(choice: dict[str, Any], kind: str, text: str, stream: bool) -> None:
    if kind == "completion":
        choice["text"] = text
        return
    key = "delta" if stream else "message"
    holder = choice.setdefault(key, {"role": "assistant"} if not stream else {})
    if holder.get("content") is not None or text:
        holder["content"] = text
