"""What the generation endpoints share: a model's context (its engine, settings, metrics, adapters), admission,
engine request groups, prompts (streaming answers are in `streaming.py`, asyncio helpers in `aio.py`).

Lifecycle of one HTTP generation request::

    group = ctx.open_group(k)            # 503 if overloaded; reserves k slots (k = number of prompts)
    group.add(prompt, params, id)         # one engine request per prompt (n samples each)
    await until_disconnected(receive, group.prime() / group.collect())
    EventStreamResponse(events, on_close=group.aclose)   # streaming: the response owns the group
    await group.aclose()                  # otherwise: the handler closes it (aborts what is unfinished)

Closing a group closes its engine streams, which aborts unfinished requests in the engine and
frees their KV blocks, and gives the slots back.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from pathlib import Path
from typing import Any, AsyncIterator

from rivulet.config import RivuletError
from rivulet.engine.outputs import PoolingRequestOutput, RequestOutput
from rivulet.entrypoints.openai.aio import Deadline, close_quietly, gather_or_cancel, merge
from rivulet.entrypoints.openai.engine_client import EngineClient, EngineDeadError
from rivulet.entrypoints.openai.errors import OpenAIError, dumps
from rivulet.entrypoints.openai.launch import ServerSettings
from rivulet.entrypoints.openai.metrics import ServerMetrics
from rivulet.entrypoints.openai.tracing import REQUEST_SPAN, Tracer, now_ns
from rivulet.lora_request import LoRARequest
from rivulet.models.loader.peft import read_adapter
from rivulet.pooling_params import PoolingParams
from rivulet.sampling_params import SamplingParams

logger = logging.getLogger("rivulet.server")
request_logger = logging.getLogger("rivulet.requests")  # --log-requests: JSON lines
OFF_LOOP_CHARS = 1 << 15  # prompts longer than this are tokenized in a thread


class ServerContext:
    """Per-app state: the engine, settings, metrics, and counters of admitted and in-flight requests."""

    def __init__(self, engine: EngineClient, settings: ServerSettings, metrics: ServerMetrics | None = None,
                 tracer: Tracer | None = None) -> None:
        self.engine = engine
        self.tracer = tracer  # OpenTelemetry (--otlp-traces-endpoint); None: no traces
        self.settings = settings
        self.metrics = metrics or ServerMetrics(settings.served_model_names[0])
        self.active = 0  # engine requests admitted and not yet closed
        self.inflight = 0  # HTTP requests being answered (the gate middleware counts them)
        self.draining = False
        self.adapters: dict[str, LoRARequest] = {}  # LoRA adapters served by name (--lora-modules, runtime loads)
        self._lora_ids = itertools.count(1)
        for name, path in settings.lora_modules.items():
            self.adapters[name] = LoRARequest(name, next(self._lora_ids), path)

    # ---- models ----

    def model_name(self, requested: str | None) -> str:
        """The served name (or LoRA adapter) a request names (the first served name when it names none);
        404 if unknown."""
        names = self.settings.served_model_names
        if requested is None or requested == "":
            return names[0]
        if requested not in names and requested not in self.adapters:
            raise OpenAIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a (checked) model name stands for; None for the base model."""
        return self.adapters.get(model)

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as model `name` (vLLM's /v1/load_lora_adapter); 400 if it cannot be."""
        if self.settings.max_lora_rank is None:
            raise OpenAIError(400, "LoRA adapters are off: start the server with --enable-lora", param="lora_name")
        if not name or not path:
            raise OpenAIError(400, "lora_name and lora_path are both required", param="lora_name")
        if name in self.adapters or name in self.settings.served_model_names:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        read_adapter(path, self.settings.max_lora_rank)  # RivuletError: 400 naming the problem
        self.adapters[name] = LoRARequest(name, next(self._lora_ids), str(Path(path).expanduser().resolve()))

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`; requests already running with it finish with it."""
        if self.adapters.pop(name, None) is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              code="model_not_found")

    # ---- admission ----

    def open_group(self, count: int, lora: LoRARequest | None = None) -> RequestGroup:
        """Reserve ``count`` engine requests, or answer 503 with Retry-After when the queue is full.
        Decided from counters alone: the engine is not asked."""
        limit = self.settings.admission_limit
        if limit is not None:
            load = max(self.engine.num_unfinished_requests, self.active)
            if load + count > limit:
                self.metrics.reject("overloaded")
                raise OpenAIError(503, f"the server is overloaded ({load} requests unfinished, limit {limit}); "
                                       "retry later", code="server_overloaded",
                                  headers={"Retry-After": str(self.settings.retry_after_s)})
        self.active += count
        timeout = self.settings.request_timeout
        return RequestGroup(self, count, None if timeout is None else Deadline(timeout), lora)

    # ---- prompts ----

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """A prompt longer than this many characters cannot fit the context, whatever it says: no token of the
        tokenizer spells more characters than its longest vocabulary entry (a byte-level entry has one
        character per byte; a normalizer may merge a few characters, hence the margin of 4x). Such a prompt
        gets its 400 at once instead of after seconds of tokenizing. None without a tokenizer."""
        tok = self.engine.tokenizer
        vocab = tok.get_vocab() if tok is not None else {}
        longest = max(map(len, vocab), default=0)
        return 4 * longest * self.engine.model_info.max_model_len if longest else None

    def check_prompt_chars(self, chars: int) -> None:
        """400 ``context_length_exceeded`` for a prompt of `chars` characters that cannot fit the context."""
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise OpenAIError(400, f"this model's maximum context length is {self.engine.model_info.max_model_len} "
                                   f"tokens; a prompt of {chars} characters is longer than any prompt that fits "
                                   f"({limit} characters at most)", param="prompt", code="context_length_exceeded")

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt string or token-id list; 400 if it cannot be tokenized."""
        tok = self.engine.tokenizer
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
        try:
            if isinstance(prompt, str) and tok is not None:
                return prompt, list(tok(prompt, add_special_tokens=add_special_tokens).input_ids)
            return self.engine.processor.tokenize_prompt(prompt)
        except RivuletError:
            raise
        except Exception as e:  # a tokenizer failing on odd input is the input's fault
            raise OpenAIError(400, f"cannot tokenize the prompt: {e}", param="prompt") from None

    async def tokenize_off_loop(self, prompt: str | list[int],
                                add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """`tokenize`, in a thread when the prompt is long, so one large prompt does not stall every
        other stream on the event loop (the Rust tokenizer releases the GIL)."""
        if isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(self.tokenize, prompt, add_special_tokens)
        return self.tokenize(prompt, add_special_tokens)

    def truncate_prompt(self, text: str | None, ids: list[int], keep: int | None) -> tuple[str | None, list[int]]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as the context holds)."""
        n = self.engine.model_info.max_model_len if keep == -1 else keep
        return (text, ids) if n is None or len(ids) <= n else (None, ids[-n:])

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids ("" without a tokenizer)."""
        tok = self.engine.tokenizer
        if tok is None:
            return ""
        try:
            return tok.decode(token_ids)
        except Exception as e:
            raise OpenAIError(400, f"cannot decode the token ids: {e}", param="tokens") from None

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """What a request without ``max_tokens`` may generate: the rest of the context (at least 1)."""
        return max(1, self.engine.model_info.max_model_len - num_prompt_tokens)


class RequestGroup:
    """The engine requests of one HTTP request; ``aclose()`` aborts what is unfinished and frees the slots."""

    def __init__(self, ctx: ServerContext, slots: int, deadline: Deadline | None = None,
                 lora: LoRARequest | None = None) -> None:
        self.ctx = ctx
        self.slots = slots
        self.deadline = deadline
        self.lora = lora  # every request of the group runs with this LoRA adapter (None: the base model)
        self.streams: list[AsyncIterator[RequestOutput]] = []
        self.closed = False
        self.span = REQUEST_SPAN.get() if ctx.tracer is not None else None  # the HTTP request's trace span

    def add(self, prompt: Any, params: SamplingParams | PoolingParams, request_id: str, priority: int = 0) -> None:
        """Add one engine request (an embedding with PoolingParams); it reaches the engine when its stream is
        first read."""
        self.streams.append(self._tracked(prompt, params, request_id, priority))

    async def _tracked(self, prompt: Any, params: SamplingParams | PoolingParams, request_id: str,
                       priority: int) -> AsyncIterator[RequestOutput]:
        tracker = self.ctx.metrics.tracker()
        gen = self.ctx.engine.generate(prompt, params, request_id, priority, self.lora)
        n = params.n if isinstance(params, SamplingParams) else 1
        arrival_ns, first_ns, last = now_ns(), None, None
        try:
            async for out in gen:
                tracker.observe(out)
                last = out
                if first_ns is None and isinstance(out, RequestOutput) and any(c.token_ids for c in out.outputs):
                    first_ns = now_ns()
                yield out
        except RivuletError:
            tracker.done = True  # rejected before it started: not a served request
            raise
        except EngineDeadError:
            tracker.abort(n, "error")
            raise
        finally:
            tracker.abort(n)  # no-op when it finished
            await close_quietly(gen)
            end_ns = now_ns()
            if self.span is not None and self.ctx.tracer is not None:
                self.ctx.tracer.engine_request(self.span, request_id, arrival_ns, first_ns, end_ns, last, params)
            if self.ctx.settings.log_requests:
                log_request(self.ctx, request_id, arrival_ns, first_ns, end_ns, last)

    async def prime(self) -> list[RequestOutput]:
        """The first output of every request, all submitted at once; the first error raises (invalid
        input surfaces here, before any response is sent)."""
        try:
            firsts = await gather_or_cancel([anext(s) for s in self.streams])  # type: ignore[arg-type]
        except StopAsyncIteration:
            raise OpenAIError(500, "the engine ended a request without output") from None
        check_errors(firsts)
        return firsts

    async def collect(self) -> list[RequestOutput]:
        """The final output of every request."""
        async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            out: RequestOutput | None = None
            async for out in stream:
                pass
            if out is None:
                raise OpenAIError(500, "the engine ended a request without output")
            return out

        finals = await gather_or_cancel([last(s) for s in self.streams])
        check_errors(finals)
        return finals

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(request index, snapshot) as they come, after ``prime``."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, out
            return
        async for item in merge(self.streams):
            yield item

    async def aclose(self) -> None:
        """Close every stream (aborting unfinished requests) and give the slots back; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            for stream in self.streams:
                await close_quietly(stream)  # type: ignore[arg-type]
        finally:
            self.ctx.active -= self.slots


def log_request(ctx: ServerContext, request_id: str, arrival_ns: int, first_ns: int | None, end_ns: int,
                out: RequestOutput | PoolingRequestOutput | None) -> None:
    """One JSON line for a finished (or abandoned) engine request: `--log-requests`; text only with
    `--log-request-text`."""
    line: dict[str, Any] = {"time": round(end_ns / 1e9, 3), "request_id": request_id,
                            "model": ctx.settings.served_model_names[0], "e2e_s": round((end_ns - arrival_ns) / 1e9, 4)}
    if first_ns is not None:
        line["ttft_s"] = round((first_ns - arrival_ns) / 1e9, 4)
    if out is not None:
        line["prompt_tokens"] = len(out.prompt_token_ids)
        if out.first_scheduled_time is not None:
            line["queue_s"] = round(max(0.0, out.first_scheduled_time - arrival_ns / 1e9), 4)
        if isinstance(out, PoolingRequestOutput):
            line["kind"], line["finish_reasons"] = "embedding", ["error" if out.error else "stop"]
        else:
            line["completion_tokens"] = sum(len(c.token_ids) for c in out.outputs)
            line["finish_reasons"] = [c.finish_reason or "abort" for c in out.outputs]
        if ctx.settings.log_request_text:
            line["prompt"] = out.prompt
            if isinstance(out, RequestOutput):
                line["outputs"] = [c.text for c in out.outputs]
    request_logger.info(dumps(line))


def check_errors(outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
    """400 when the engine refused a request (a choice, or an embedding, finished with ``error``)."""
    for out in outputs:
        if isinstance(out, PoolingRequestOutput):
            if out.error is not None:
                raise OpenAIError(400, out.error)
            continue
        for c in out.outputs:
            if c.finish_reason == "error":
                raise OpenAIError(400, c.error or "the engine rejected the request")
