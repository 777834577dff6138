"""``POST /v1/chat/completions``: the conversation rendered with the model's chat template (and its
tools), then one engine request with ``n`` samples, streamed or not; tool calls found in the answer
(`tools.py`) come back as ``message.tool_calls``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from rivulet.config import RivuletError
from rivulet.engine.outputs import RequestOutput
from rivulet.entrypoints.openai.errors import JSONBody, OpenAIError
from rivulet.entrypoints.openai.logprobs import chat_logprobs, token_text_fn
from rivulet.entrypoints.openai.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                                 ChatMessage, ChatResponseMessage)
from rivulet.entrypoints.openai.protocol import Usage as UsageModel
from rivulet.entrypoints.openai.aio import ClientDisconnected, until_disconnected
from rivulet.entrypoints.openai.serving_base import OFF_LOOP_CHARS, RequestGroup, ServerContext
from rivulet.entrypoints.openai.streaming import (SSE_DONE, ChoiceState, EventStreamResponse, Usage, sse,
                                                 stream_error_event)
from rivulet.entrypoints.openai.reasoning import END, START, ReasoningStream, reasoning_fields, split_reasoning
from rivulet.entrypoints.openai.tools import ToolCall, ToolPlan, plan_tools, streamable_prefix

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
        for call in d.get("tool_calls") or []:  # templates write arguments with tojson: give them the object
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
        result.append(d)
    return result


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any] | None,
                tools: list[dict[str, Any]] | None = None, chat_template: str | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation (with `tools` for the template, and the server's
    `--chat-template` in place of the model's); 400 when the template refuses it."""
    if tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with "
                               "token ids")
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    if tools:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs.setdefault("chat_template", chat_template)
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
        settings = ctx.settings
        plan = plan_tools(body.tools, body.tool_choice, settings.tool_call_parser is not None)  # RivuletError: 400
        group = ctx.open_group(1, ctx.lora_request(model))
        handed_over = False
        try:
            args = (ctx.engine.tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                    body.chat_template_kwargs, plan.render, body.chat_template or settings.chat_template)
            size = sum(len(m.content) if isinstance(m.content, str) else 0 for m in body.messages)
            ctx.check_prompt_chars(size)
            # a long conversation is rendered and tokenized in a thread: the event loop keeps serving the others
            text, ids = await asyncio.to_thread(render_chat, *args) if size > OFF_LOOP_CHARS else render_chat(*args)
            text, ids = ctx.truncate_prompt(text, ids, body.truncate_prompt_tokens)
            text = ctx.decode(ids) if text is None else text  # (cut: the text of what is kept)
            params = body.to_sampling_params(ctx.default_max_tokens(len(ids)))
            if plan.structured is not None:
                if params.structured_outputs is not None:
                    raise RivuletError(f"tool_choice {json.dumps(body.tool_choice)} is a grammar of its own: "
                                       "drop response_format / structured_outputs / guided_*")
                params = dataclasses.replace(params, structured_outputs=plan.structured)
            if settings.reasoning_parser and params.structured_outputs is not None \
                    and (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False:
                end = list(ctx.engine.tokenizer(END, add_special_tokens=False).input_ids)  # the grammar follows it
                params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                    params.structured_outputs, after_token_ids=end))
            # a template that opens the thinking itself (Qwen3's thinking-only models end the prompt in "<think>"):
            # the answer starts inside it
            opened = settings.reasoning_parser is not None and text.rstrip().endswith(START)
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            group.add({"prompt": text, "prompt_token_ids": ids, "cache_salt": body.cache_salt}, params, request_id,
                      body.priority)
            if body.stream:
                firsts = await until_disconnected(raw.receive, group.prime(), group.deadline)
                events = self._events(body, model, request_id, ids, group, firsts[0], plan, opened)
                handed_over = True
                return EventStreamResponse(events, on_close=group.aclose, deadline=group.deadline)
            finals = await until_disconnected(raw.receive, group.collect(), group.deadline)
            return JSONBody(self._response(body, model, request_id, finals[0], plan, opened).model_dump())
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            if not handed_over:
                await group.aclose()

    def _num_top(self, body: ChatCompletionRequest) -> int:
        return body.top_logprobs or 0

    def _response(self, body: ChatCompletionRequest, model: str, request_id: str,
                  out: RequestOutput, plan: ToolPlan, opened: bool = False) -> ChatCompletionResponse:
        text_fn = token_text_fn(self.ctx.engine.tokenizer)
        choices = []
        for c in out.outputs:
            logprobs = chat_logprobs(c.token_ids, c.logprobs or [], self._num_top(body), text_fn) \
                if body.logprobs else None
            parser = self.ctx.settings.reasoning_parser
            reasoning, text = split_reasoning(parser, START * opened + c.text) if parser else (None, c.text)
            content, calls = plan.calls(text, self.ctx.settings.tool_call_parser)
            if reasoning is not None and not content:
                content = None
            message = ChatResponseMessage(content=content, tool_calls=[t.as_dict() for t in calls] or None,
                                          **reasoning_fields(reasoning))
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason=_finish_reason(c.finish_reason, calls), stop_reason=c.stop_reason,
                                      token_ids=list(c.token_ids) if body.return_token_ids else None))
        usage = Usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=UsageModel(**usage.as_dict()),
                                      prompt_token_ids=list(out.prompt_token_ids) if body.return_token_ids else None)

    async def _events(self, body: ChatCompletionRequest, model: str, request_id: str, prompt_ids: list[int],
                      group: RequestGroup, first: RequestOutput, plan: ToolPlan,
                      opened: bool = False) -> AsyncIterator[str]:
        created = int(time.time())
        states = [ChoiceState() for _ in range(body.n)]
        tools = [_ToolStream(plan, self.ctx.settings.tool_call_parser) for _ in range(body.n)]
        parser = self.ctx.settings.reasoning_parser
        thinking = [ReasoningStream(parser, opened) for _ in range(body.n)] if parser else None
        text_fn = token_text_fn(self.ctx.engine.tokenizer)

        def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None,
                  stop_reason: int | str | None = None, token_ids: list[int] | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": stop_reason}
            obj: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "choices": [choice]}
            if body.return_token_ids:  # vLLM's fields: the prompt's ids in the first chunk, then each delta's ids
                choice["token_ids"] = token_ids or []
                if "role" in delta and index == 0:
                    obj["prompt_token_ids"] = prompt_ids
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
                new, thought = d.text, ""
                if thinking is not None:
                    thought, new = thinking[c.index].feed(d.text, final=d.finish_reason is not None)
                if plan.mode == "none":
                    deltas, finish = ([{"content": new}] if new else []), d.finish_reason
                else:
                    deltas, finish = tools[c.index].feed(new, d.finish_reason)
                if thought:
                    deltas = [reasoning_fields(thought)] + deltas
                ids = list(d.token_ids) if body.return_token_ids else None
                for i, delta in enumerate(deltas or [{}]):
                    last_one = i == max(len(deltas), 1) - 1
                    if delta or (logprobs and i == 0) or (finish and last_one) or (ids and i == 0):
                        events.append(chunk(c.index, delta, logprobs if i == 0 else None, finish if last_one else None,
                                            d.stop_reason if last_one else None, ids if i == 0 else None))
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
                usage = Usage(len(prompt_ids), sum(len(c.token_ids) for c in last.outputs), last.num_cached_tokens)
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": usage.as_dict()})
            yield SSE_DONE
        except Exception as e:
            yield stream_error_event(e)


def _finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


class _ToolStream:
    """One choice's stream under a tool plan: the deltas to send for each new piece of text. A named
    function streams its arguments as they come; "required" and "auto" hold back what may be a tool
    call and send the calls, one delta each, when the answer ends."""

    def __init__(self, plan: ToolPlan, parser: str | None) -> None:
        self.plan, self.parser = plan, parser
        self.text = ""
        self.sent = 0  # characters of text sent as content (auto)
        self.call: ToolCall | None = None  # the named call, once started

    def feed(self, new: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        self.text += new
        plan = self.plan
        if plan.mode == "named":
            deltas = []
            if self.call is None:
                self.call = ToolCall(plan.name or "", "")
                deltas.append({"tool_calls": [{"index": 0, "id": self.call.id, "type": "function",
                                               "function": {"name": self.call.name, "arguments": new}}]})
            elif new:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": new}}]})
            return deltas, _finish_reason(finish, [self.call]) if finish else None
        deltas = []
        if finish is None:
            if plan.mode == "auto":
                safe = streamable_prefix(self.parser, self.text)
                if safe > self.sent:
                    deltas.append({"content": self.text[self.sent:safe]})
                    self.sent = safe
            return deltas, None
        content, calls = plan.calls(self.text, self.parser)
        if content and content.startswith(self.text[:self.sent]) and len(content) > self.sent:
            deltas.append({"content": content[self.sent:]})
        elif content is None and not calls and self.sent < len(self.text):
            deltas.append({"content": self.text[self.sent:]})
        for i, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}]})
        return deltas, _finish_reason(finish, calls)
