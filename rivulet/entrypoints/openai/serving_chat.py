"""``POST /v1/chat/completions``: the conversation rendered with the model's chat template, then one
engine request with ``n`` samples, streamed or not."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from rivulet.engine.outputs import RequestOutput
from rivulet.entrypoints.openai.errors import JSONBody, OpenAIError
from rivulet.entrypoints.openai.logprobs import chat_logprobs, token_text_fn
from rivulet.entrypoints.openai.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                                 ChatMessage, ChatResponseMessage)
from rivulet.entrypoints.openai.protocol import Usage as UsageModel
from rivulet.entrypoints.openai.serving_base import (SSE_DONE, ChoiceState, ClientDisconnected, EventStreamResponse,
                                                     RequestGroup, ServerContext, Usage, sse, stream_error_event,
                                                     until_disconnected)

# chat_template_kwargs a client may not override: they change what apply_chat_template returns
_RESERVED_TEMPLATE_KWARGS = {"conversation", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
                             "max_length", "tokenizer_kwargs", "add_generation_prompt", "continue_final_message"}


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: content parts joined into one string (text only)."""
    result = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise OpenAIError(400, f"messages[{i}]: content parts of type {part.type!r} are not supported "
                                           "(only text)", param="messages")
                texts.append(part.text)
            d["content"] = "\n".join(texts)
        d.setdefault("content", "")  # templates index message.content; null (assistant tool calls) reads as ""
        result.append(d)
    return result


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any] | None) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation; 400 when the template refuses it."""
    if tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with "
                               "token ids")
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    try:
        text = tokenizer.apply_chat_template(message_dicts(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt and not continue_final_message,
                                             continue_final_message=continue_final_message, **kwargs)
        if not isinstance(text, str):
            raise ValueError("the chat template did not return text")
        return text, list(tokenizer(text, add_special_tokens=False).input_ids)
    except OpenAIError:
        raise
    except Exception as e:  # jinja errors, template exceptions, odd kwargs: the request's fault
        raise OpenAIError(400, f"cannot apply the chat template: {e}", param="messages") from None


class ChatHandler:
    """Serves ``/v1/chat/completions`` for one app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """Validate, render, run, and answer (JSON or SSE)."""
        ctx = self.ctx
        model = ctx.model_name(body.model)
        if body.stream_options is not None and not body.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if body.top_logprobs and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        group = ctx.open_group(1)
        handed_over = False
        try:
            text, ids = render_chat(ctx.engine.tokenizer, body.messages, body.add_generation_prompt,
                                    body.continue_final_message, body.chat_template_kwargs)
            params = body.to_sampling_params(ctx.default_max_tokens(len(ids)))
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            group.add({"prompt": text, "prompt_token_ids": ids}, params, request_id, body.priority)
            if body.stream:
                firsts = await until_disconnected(raw.receive, group.prime())
                events = self._events(body, model, request_id, len(ids), group, firsts[0])
                handed_over = True
                return EventStreamResponse(events, on_close=group.aclose)
            finals = await until_disconnected(raw.receive, group.collect())
            return JSONBody(self._response(body, model, request_id, finals[0]).model_dump())
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            if not handed_over:
                await group.aclose()

    def _num_top(self, body: ChatCompletionRequest) -> int:
        return body.top_logprobs or 0

    def _response(self, body: ChatCompletionRequest, model: str, request_id: str,
                  out: RequestOutput) -> ChatCompletionResponse:
        text_fn = token_text_fn(self.ctx.engine.tokenizer)
        choices = []
        for c in out.outputs:
            logprobs = chat_logprobs(c.token_ids, c.logprobs or [], self._num_top(body), text_fn) \
                if body.logprobs else None
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=logprobs,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage = Usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=UsageModel(**usage.as_dict()))

    async def _events(self, body: ChatCompletionRequest, model: str, request_id: str, num_prompt_tokens: int,
                      group: RequestGroup, first: RequestOutput) -> AsyncIterator[str]:
        created = int(time.time())
        states = [ChoiceState() for _ in range(body.n)]
        text_fn = token_text_fn(self.ctx.engine.tokenizer)

        def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None,
                  stop_reason: int | str | None = None) -> str:
            obj: dict[str, Any] = {
                "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                             "stop_reason": stop_reason}]}
            if body.include_usage:
                obj["usage"] = None
            return sse(obj)

        def chunks(out: RequestOutput) -> list[str]:
            events = []
            for c in out.outputs:
                d = states[c.index].delta(c)
                if d is None:
                    continue
                logprobs = None
                if body.logprobs and d.token_ids:
                    logprobs = chat_logprobs(d.token_ids, d.logprobs or [], self._num_top(body), text_fn).model_dump()
                delta = {"content": d.text} if d.text else {}
                if delta or logprobs or d.finish_reason:
                    events.append(chunk(c.index, delta, logprobs, d.finish_reason, d.stop_reason))
            return events

        last = first
        try:
            for i in range(body.n):  # the role comes first, once per choice
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            for event in chunks(first):
                yield event
            async for _, out in group.outputs():
                last = out
                for event in chunks(out):
                    yield event
            if body.include_usage:
                usage = Usage(num_prompt_tokens, sum(len(c.token_ids) for c in last.outputs))
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": usage.as_dict()})
            yield SSE_DONE
        except Exception as e:
            yield stream_error_event(e)
