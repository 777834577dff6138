"""LLMEngine: text in, text out around an EngineCore.

Input side: tokenize, validate, fan a request with ``n`` samples out into ``n`` core requests
(they share the prompt's KV blocks through the prefix cache). Output side: incremental
detokenization, stop strings, logprobs, and one RequestOutput per user request.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from rivulet.config import EngineConfig, RivuletError
from rivulet.core import Request
from rivulet.core.request import RequestStatus
from rivulet.engine.core import EngineCore, StepOutput
from rivulet.engine.detokenizer import IncrementalDetokenizer
from rivulet.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from rivulet.engine.tokenizer import eos_token_ids, load_tokenizer
from rivulet.models.loader import resolve_model
from rivulet.sampling_params import SamplingParams
from rivulet.worker.outputs import TokenLogprobs

PromptType = str | dict[str, Any] | list[int]


@dataclass
class _Sample:
    parent: str
    index: int
    detok: IncrementalDetokenizer | None
    output: CompletionOutput


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = resolve_model(config.model.model)
        self.core = EngineCore(config, self.source)  # validates the architecture before anything slow
        self.tokenizer = load_tokenizer(self.source, config.model.tokenizer)
        arch = self.core.executor.arch_config
        self.vocab_size = arch.vocab_size
        self.max_model_len = config.scheduler.max_model_len
        self.eos_token_ids = eos_token_ids(self.source, arch.eos_token_ids, self.tokenizer)
        self.core.executor.set_eos_token_ids(self.eos_token_ids)
        self._requests: dict[str, RequestOutput] = {}
        self._samples: dict[str, _Sample] = {}  # core request id -> sample state
        self._ids = itertools.count()

    # ---- input ----

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a string, a token-id list, or {"prompt"/"prompt_token_ids": ...}."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise RivuletError("a prompt is a string, a list of token ids, or {'prompt_token_ids': [...]}")
        if self.tokenizer is None:
            raise RivuletError("this model has no tokenizer: give prompts as token ids")
        return text, self.tokenizer(text).input_ids

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0) -> str:
        """Validate and queue a request; raises RivuletError (a ValueError) on bad input."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise RivuletError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self._validate(ids, params)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        outputs = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self._requests[request_id] = RequestOutput(request_id, text, ids, outputs,
                                                   [None] * len(ids) if params.prompt_logprobs is not None else None)
        for i in range(params.n):
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            if i > 0 and p.prompt_logprobs is not None:
                p = replace(p, prompt_logprobs=None)
            detok = IncrementalDetokenizer.from_params(self.tokenizer, ids, p) if self.tokenizer else None
            self._samples[cid] = _Sample(request_id, i, detok, outputs[i])
            self.core.add_request(Request(
                cid, ids, max_tokens, () if p.ignore_eos else self.eos_token_ids, p.stop_token_ids or (),
                p.min_tokens, priority, sampling_params=p, use_prefix_cache=p.prompt_logprobs is None))
        return request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RivuletError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RivuletError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        params.validate_for_vocab(self.vocab_size)
        want = len(ids) + (params.max_tokens or 1)
        if len(ids) >= self.max_model_len or want > self.max_model_len:
            raise RivuletError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request needs {want} "
                f"({len(ids)} in the prompt, {params.max_tokens or 1} for the completion)")

    def abort_request(self, request_id: str) -> None:
        out = self._requests.pop(request_id, None)
        if out is None:
            return
        ids = [cid for cid, s in self._samples.items() if s.parent == request_id]
        self.core.abort_requests(ids)
        for cid in ids:
            del self._samples[cid]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- output ----

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that progressed (finished ones for the last time)."""
        touched: dict[str, RequestOutput] = {}
        for so in self.core.step():
            sample = self._samples.get(so.core.request_id)
            if sample is None:
                continue
            req = self._requests[sample.parent]
            self._apply(sample, so, req)
            touched[sample.parent] = req
        for rid, req in touched.items():
            if req.finished:
                del self._requests[rid]
        return list(touched.values())

    def _apply(self, sample: _Sample, so: StepOutput, req: RequestOutput) -> None:
        o, c = sample.output, so.core
        if so.prompt_logprobs and req.prompt_logprobs is not None:
            start, entries = so.prompt_logprobs  # a recompute after preemption rewrites the same slots
            req.prompt_logprobs[start:start + len(entries)] = [self._position(e) if e else None for e in entries]
        req.num_cached_tokens = max(req.num_cached_tokens, c.num_cached_tokens)
        if o.finished:
            return
        o.token_ids.extend(c.new_token_ids)
        if o.logprobs is not None:
            for lp in so.logprobs:
                o.logprobs.append(self._position(lp))
                o.cumulative_logprob = (o.cumulative_logprob or 0.0) + lp.logprob
        if sample.detok is not None:
            text_ids = c.new_token_ids
            if c.finish_reason == "stop" and isinstance(c.stop_reason, int):
                text_ids = text_ids[:-1]  # the eos / stop token itself is not text
            sample.detok.update(text_ids)
            if sample.detok.finished and not c.finish_reason:  # a stop string matched
                self.core.finish_requests([c.request_id], RequestStatus.FINISHED_STOPPED)
                c.finish_reason, c.stop_reason = "stop", sample.detok.stop_reason
            elif sample.detok.finished:
                c.stop_reason = sample.detok.stop_reason
            if c.finish_reason:
                sample.detok.flush()
            o.text = sample.detok.output_text
        if c.finish_reason:
            o.finish_reason, o.stop_reason, o.error = c.finish_reason, c.stop_reason, c.error
            del self._samples[c.request_id]

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        dec = (lambda t: self.tokenizer.decode([t])) if self.tokenizer else (lambda t: None)
        pos = {t: Logprob(v, i + 1, dec(t)) for i, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        pos[lp.token_id] = Logprob(lp.logprob, lp.rank, dec(lp.token_id))
        return pos
