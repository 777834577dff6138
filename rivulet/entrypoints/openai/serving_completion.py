"""``POST /v1/completions``: one engine request per prompt (``n`` samples each), streamed or not.

Choice ``i`` of prompt ``p`` is index ``p * n + i``. With ``echo`` the prompt text comes first (and,
with ``logprobs``, the prompt's logprobs, the first one null); ``echo`` with ``max_tokens=0`` returns
only the scored prompt, which is how lm-eval computes loglikelihoods.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from rivulet.engine.outputs import CompletionOutput, RequestOutput
from rivulet.entrypoints.openai.errors import JSONBody, OpenAIError
from rivulet.entrypoints.openai.logprobs import completion_logprobs, token_text_fn
from rivulet.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                                 CompletionResponse)
from rivulet.entrypoints.openai.protocol import Usage as UsageModel
from rivulet.entrypoints.openai.aio import ClientDisconnected, until_disconnected
from rivulet.entrypoints.openai.serving_base import RequestGroup, ServerContext
from rivulet.entrypoints.openai.streaming import (SSE_DONE, ChoiceState, EventStreamResponse, Usage, sse,
                                                 stream_error_event)
from rivulet.sampling_params import SamplingParams


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


class CompletionHandler:
    """Serves ``/v1/completions`` for one app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        """Validate, run, and answer (JSON or SSE)."""
        ctx = self.ctx
        model = ctx.model_name(body.model)
        self._check(body)
        prompts = body.prompts()
        if not prompts:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        group = ctx.open_group(len(prompts), ctx.lora_request(model))
        handed_over = False
        try:
            items = []
            for p in prompts:
                text, ids = ctx.truncate_prompt(*await ctx.tokenize_off_loop(p, body.add_special_tokens),
                                                body.truncate_prompt_tokens)
                items.append(_Prompt(text, ids, body.to_sampling_params(ctx.default_max_tokens(len(ids)))))
            request_id = f"cmpl-{uuid.uuid4().hex}"
            for i, item in enumerate(items):
                group.add({"prompt": item.text, "prompt_token_ids": item.token_ids, "cache_salt": body.cache_salt}, item.params,
                          f"{request_id}-{i}", body.priority)
            if body.stream:
                firsts = await until_disconnected(raw.receive, group.prime(), group.deadline)
                events = self._events(body, model, request_id, items, group, firsts)
                handed_over = True
                return EventStreamResponse(events, on_close=group.aclose, deadline=group.deadline)
            finals = await until_disconnected(raw.receive, group.collect(), group.deadline)
            return JSONBody(self._response(body, model, request_id, items, finals).model_dump())
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            if not handed_over:
                await group.aclose()

    @staticmethod
    def _check(body: CompletionRequest) -> None:
        if body.stream_options is not None and not body.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if body.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise OpenAIError(400, "best_of is not supported (only best_of == n)", param="best_of")
        if body.max_tokens == 0 and not body.echo:
            raise OpenAIError(400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens")

    # ---- pieces shared by both answers ----

    def _echo_only(self, body: CompletionRequest) -> bool:
        return body.echo and body.max_tokens == 0

    def _prompt_text(self, item: _Prompt) -> str:
        return item.text if item.text is not None else self.ctx.decode(item.token_ids)

    def _prompt_logprobs(self, body: CompletionRequest, item: _Prompt, out: RequestOutput) -> CompletionLogprobs:
        positions = out.prompt_logprobs or [None] * len(item.token_ids)
        return completion_logprobs(item.token_ids, positions, body.logprobs or 0,
                                   token_text_fn(self.ctx.engine.tokenizer))

    # ---- non-streaming ----

    def _response(self, body: CompletionRequest, model: str, request_id: str, items: list[_Prompt],
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        usage = Usage()
        for p, (item, out) in enumerate(zip(items, finals)):
            usage.prompt_tokens += len(item.token_ids)
            usage.cached_tokens += out.num_cached_tokens
            for c in out.outputs:
                choices.append(self._choice(body, p * body.n + c.index, item, out, c))
                usage.completion_tokens += 0 if self._echo_only(body) else len(c.token_ids)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=UsageModel(**usage.as_dict()))

    def _choice(self, body: CompletionRequest, index: int, item: _Prompt, out: RequestOutput,
                c: CompletionOutput) -> CompletionChoice:
        echo_only = self._echo_only(body)
        prefix = self._prompt_text(item) if body.echo else ""
        text = prefix + ("" if echo_only else c.text)
        logprobs = None
        if body.logprobs is not None:
            logprobs = self._prompt_logprobs(body, item, out) if body.echo else CompletionLogprobs()
            if not echo_only:
                gen = completion_logprobs(c.token_ids, c.logprobs or [], body.logprobs,
                                          token_text_fn(self.ctx.engine.tokenizer), len(prefix))
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, name).extend(getattr(gen, name))
        finish = "length" if echo_only else c.finish_reason
        ids = body.return_token_ids
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish,
                                stop_reason=None if echo_only else c.stop_reason,
                                prompt_token_ids=item.token_ids if ids else None,
                                token_ids=([] if echo_only else list(c.token_ids)) if ids else None)

    # ---- streaming ----

    async def _events(self, body: CompletionRequest, model: str, request_id: str, items: list[_Prompt],
                      group: RequestGroup, firsts: list[RequestOutput]) -> AsyncIterator[str]:
        created = int(time.time())
        states = {(p, i): ChoiceState() for p in range(len(items)) for i in range(body.n)}
        echoed: set[tuple[int, int]] = set()
        started: set[tuple[int, int]] = set()  # choices whose first chunk was sent
        text_fn = token_text_fn(self.ctx.engine.tokenizer)
        echo_only = self._echo_only(body)

        def chunk(index: int, text: str, logprobs: CompletionLogprobs | None, finish: str | None,
                  stop_reason: int | str | None, token_ids: list[int], prompt_ids: list[int] | None) -> str:
            choice: dict[str, Any] = {"index": index, "text": text,
                                      "logprobs": logprobs.model_dump() if logprobs else None,
                                      "finish_reason": finish, "stop_reason": stop_reason}
            if body.return_token_ids:  # vLLM's fields: the prompt's ids in a choice's first chunk, then each delta's
                if prompt_ids is not None:
                    choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = token_ids
            obj = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                   "choices": [choice]}
            if body.include_usage:
                obj["usage"] = None
            return sse(obj)

        def chunks(p: int, out: RequestOutput) -> list[str]:
            events = []
            for c in out.outputs:
                key, state = (p, c.index), states[(p, c.index)]
                text, logprobs = "", None
                first = key not in started
                if body.echo and key not in echoed:
                    echoed.add(key)
                    text = self._prompt_text(items[p])
                    if body.logprobs is not None:
                        logprobs = self._prompt_logprobs(body, items[p], out)
                    state.chars_emitted = len(text)
                d = state.delta(c)
                if d is None and not text:
                    continue
                finish = stop_reason = None
                if d is not None and not echo_only:
                    text += d.text
                    if body.logprobs is not None:
                        gen = completion_logprobs(d.token_ids, d.logprobs or [], body.logprobs, text_fn,
                                                  state.chars_emitted)
                        logprobs = logprobs or CompletionLogprobs()
                        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                            getattr(logprobs, name).extend(getattr(gen, name))
                    state.chars_emitted += len(d.text)
                if d is not None and d.finish_reason is not None:
                    finish = "length" if echo_only else d.finish_reason
                    stop_reason = None if echo_only else d.stop_reason
                ids = [] if d is None or echo_only else list(d.token_ids)
                if text or finish or (logprobs and logprobs.tokens) or (body.return_token_ids and (ids or first)):
                    events.append(chunk(p * body.n + c.index, text, logprobs, finish, stop_reason, ids,
                                        items[p].token_ids if first else None))
                    started.add(key)
            return events

        last: dict[int, RequestOutput] = {}
        try:
            for p, out in enumerate(firsts):
                last[p] = out
                for event in chunks(p, out):
                    yield event
            async for p, out in group.outputs():
                last[p] = out
                for event in chunks(p, out):
                    yield event
            if body.include_usage:
                usage = Usage(prompt_tokens=sum(len(it.token_ids) for it in items),
                              cached_tokens=sum(out.num_cached_tokens for out in last.values()))
                if not echo_only:
                    usage.completion_tokens = sum(len(c.token_ids) for out in last.values() for c in out.outputs)
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage.as_dict()})
            yield SSE_DONE
        except Exception as e:
            yield stream_error_event(e)
