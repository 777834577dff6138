"""Both ends of a request around the EngineCore, shared by the offline LLMEngine and AsyncLLM.

Input: tokenize, validate, fan a request with ``n`` samples out into ``n`` core Requests (they
share the prompt's KV blocks through the prefix cache); an embedding request (PoolingParams) is one. Output: incremental detokenization, stop
strings, logprobs, and one RequestOutput per user request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any


from rivulet.config import LoRAConfig, RivuletError
from rivulet.core import Request
from rivulet.engine.detokenizer import IncrementalDetokenizer
from rivulet.engine.outputs import (CompletionOutput, EmbeddingOutput, Logprob, ModelInfo, PoolingRequestOutput,
                                    PositionLogprobs, RequestOutput, StepOutput)
from rivulet.lora_request import LoRARequest
from rivulet.models.loader.peft import read_adapter
from rivulet.pooling_params import PoolingParams
from rivulet.sampling_params import SamplingParams
from rivulet.worker.outputs import TokenLogprobs

if TYPE_CHECKING:  # transformers takes ~1 s to import: loaded with the tokenizer, off the start-up path
    from transformers import PreTrainedTokenizerBase

PromptType = str | dict[str, Any] | list[int]
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})  # a dict prompt's fields (as vLLM's)


@dataclass
class _Sample:
    parent: str
    index: int
    detok: IncrementalDetokenizer | None
    output: CompletionOutput


class RequestProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, info: ModelInfo,
                 check_grammars: bool = False, lora: LoRAConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.lora_config = lora
        self._adapters: dict[int, LoRARequest] = {}  # adapter id -> the adapter checked under it
        # parse structured-output grammars here (in-process engines; xgrammar loads torch), else the core does
        self.check_grammars = check_grammars
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.eos_token_ids = info.eos_token_ids
        self.info = info
        self.task = info.task
        self.requests: dict[str, RequestOutput | PoolingRequestOutput] = {}
        self._samples: dict[str, _Sample] = {}  # core request id -> sample state

    # ---- input ----

    def tokenize_prompt(self, prompt: PromptType, truncate: int | None = None) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a string, a token-id list, or {"prompt"/"prompt_token_ids": ...};
        at most `truncate` tokens (cut as the tokenizer cuts: its special tokens stay)."""
        text, ids = self._tokenize(prompt, truncate)
        if truncate is not None and len(ids) > truncate:
            side = getattr(self.tokenizer, "truncation_side", "right")
            ids = ids[-truncate:] if side == "left" else ids[:truncate]
        return text, ids

    def _tokenize(self, prompt: PromptType, truncate: int | None) -> tuple[str | None, list[int]]:
        unknown = sorted(set(prompt) - PROMPT_KEYS) if isinstance(prompt, dict) else []
        if unknown:
            raise RivuletError(f"unknown prompt field {unknown[0]!r}; a prompt dict has {', '.join(sorted(PROMPT_KEYS))}")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise RivuletError("a prompt is a string, a list of token ids, or {'prompt_token_ids': [...]}")
        if self.tokenizer is None:
            raise RivuletError("this model has no tokenizer: give prompts as token ids")
        if truncate is not None:
            return text, self.tokenizer(text, truncation=True, max_length=truncate).input_ids
        return text, self.tokenizer(text).input_ids

    def check_adapter(self, lora: LoRARequest) -> LoRARequest:
        """`lora` with its fingerprint, its files checked (once per id: an id names one adapter's files)."""
        if self.lora_config is None:
            raise RivuletError(f"LoRA adapter {lora.lora_name!r} requested, but LoRA is off: start with --enable-lora")
        known = self._adapters.get(lora.lora_int_id)
        if known is not None and known.lora_path == lora.lora_path:
            return replace(lora, fingerprint=known.fingerprint)
        info = read_adapter(lora.lora_path, self.lora_config.max_lora_rank)
        weights = (info.path / "adapter_model.safetensors").stat()
        checked = replace(lora, fingerprint=f"{weights.st_size}-{weights.st_mtime_ns}")
        self._adapters[lora.lora_int_id] = checked
        return checked

    def make_requests(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                      priority: int = 0, lora: LoRARequest | None = None) -> list[Request]:
        """Validate and register a request; returns the core requests to queue (one per sample, one for an
        embedding). Raises RivuletError (a ValueError) on bad input, registering nothing."""
        if request_id in self.requests:
            raise RivuletError(f"request id {request_id!r} is already in use")
        embed = isinstance(params, PoolingParams)
        if embed != (self.task == "embed"):
            raise RivuletError("this model serves embeddings (--task embed): ask it for them (LLM.embed, "
                               "/v1/embeddings), not for text" if self.task == "embed" else
                               "this model generates text: embeddings need a model started with --task embed")
        truncate = params.truncate_prompt_tokens
        if truncate == -1:
            truncate = self.max_model_len
        if isinstance(params, PoolingParams):
            text, ids = self.tokenize_prompt(prompt, truncate)
            return [self._pooling_request(request_id, text, ids, params, priority, lora)]
        text, ids = self.tokenize_prompt(prompt)
        if truncate is not None and len(ids) > truncate:  # a generation keeps its prompt's end (vLLM's left cut)
            text, ids = None, ids[-truncate:]
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not (isinstance(salt, str) and salt):
            raise RivuletError(f"cache_salt must be a non-empty string, not {salt!r}")
        self._validate(ids, params)
        if lora is not None:
            lora = self.check_adapter(lora)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        outputs = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self.requests[request_id] = RequestOutput(request_id, text, ids, outputs,
                                                  [None] * len(ids) if params.prompt_logprobs is not None else None)
        core_requests = []
        so = params.structured_outputs is not None  # a grammar ends at EOS, ignore_eos or not
        for i in range(params.n):
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            if i > 0 and p.prompt_logprobs is not None:
                p = replace(p, prompt_logprobs=None)
            detok = IncrementalDetokenizer.from_params(self.tokenizer, ids, p) if self.tokenizer else None
            self._samples[cid] = _Sample(request_id, i, detok, outputs[i])
            core_requests.append(Request(
                cid, ids, max_tokens, () if p.ignore_eos and not so else self.eos_token_ids, p.stop_token_ids or (),
                p.min_tokens, priority, sampling_params=p, use_prefix_cache=p.prompt_logprobs is None,
                cache_salt=salt, lora=lora))
        return core_requests

    def _pooling_request(self, request_id: str, text: str | None, ids: list[int], params: PoolingParams,
                         priority: int, lora: LoRARequest | None) -> Request:
        if lora is not None:
            raise RivuletError("embedding requests run on the base model (no LoRA adapter)")
        if not ids:
            raise RivuletError("the input is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RivuletError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise RivuletError(f"this model's maximum input length is {self.max_model_len} tokens; the input has "
                               f"{len(ids)} (truncate_prompt_tokens cuts it)")
        if params.dimensions is not None:
            if not self.info.matryoshka:
                raise RivuletError("this model does not support 'dimensions' (it is not a Matryoshka model: a "
                                   "shorter vector would be a poor embedding)")
            if params.dimensions > self.info.hidden_size:
                raise RivuletError(f"dimensions {params.dimensions} exceeds the model's embedding size "
                                   f"({self.info.hidden_size})")
        self.requests[request_id] = PoolingRequestOutput(request_id, text, ids)
        return Request(request_id, ids, 1, priority=priority, use_prefix_cache=False, pooling_params=params)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RivuletError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RivuletError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        params.validate_for_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise RivuletError("structured output needs the model's tokenizer")
            if self.check_grammars:
                from rivulet.structured import check

                check(params.structured_outputs)
        want = len(ids) + (params.max_tokens or 1)
        if len(ids) >= self.max_model_len or want > self.max_model_len:
            raise RivuletError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request needs {want} "
                f"({len(ids)} in the prompt, {params.max_tokens or 1} for the completion)")

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the core request ids to abort."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        if isinstance(req, PoolingRequestOutput):
            return [request_id]
        ids = [cid for cid, s in self._samples.items() if s.parent == request_id]
        for cid in ids:
            del self._samples[cid]
        return ids

    # ---- output ----

    def process(self, step_outputs: list[StepOutput]) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Fold one step into the requests. Returns (requests that progressed, finished ones for the
        last time; core ids whose stop string matched, which the core must now finish)."""
        touched: dict[str, RequestOutput | PoolingRequestOutput] = {}
        stopped: list[str] = []
        for so in step_outputs:
            sample = self._samples.get(so.core.request_id)
            if sample is None:
                pooled = self.requests.get(so.core.request_id)
                if isinstance(pooled, PoolingRequestOutput) and so.core.finished:
                    self._finish_pooling(pooled, so.core)
                    touched[pooled.request_id] = pooled
                continue
            req = self.requests[sample.parent]
            if self._apply(sample, so, req):
                stopped.append(so.core.request_id)
            touched[sample.parent] = req
        for rid, req in touched.items():
            if req.finished:
                del self.requests[rid]
        return list(touched.values()), stopped

    @staticmethod
    def _finish_pooling(req: PoolingRequestOutput, c: Any) -> None:
        req.finished = True
        req.first_scheduled_time = c.scheduled_time
        if c.pooled is None:
            req.error = c.error or f"the request finished without an embedding ({c.finish_reason})"
        else:
            req.outputs = EmbeddingOutput(memoryview(c.pooled).cast("f").tolist())

    def _apply(self, sample: _Sample, so: StepOutput, req: RequestOutput) -> bool:
        """Returns True when a stop string ended the sample (the core does not know yet)."""
        o, c = sample.output, so.core
        stopped = False
        if so.prompt_logprobs and req.prompt_logprobs is not None:
            start, entries = so.prompt_logprobs  # a recompute after preemption rewrites the same slots
            req.prompt_logprobs[start:start + len(entries)] = [self._position(e) if e else None for e in entries]
        req.num_cached_tokens = max(req.num_cached_tokens, c.num_cached_tokens)
        if c.scheduled_time is not None and req.first_scheduled_time is None:
            req.first_scheduled_time = c.scheduled_time
        if o.finished:
            return False
        new_ids, logprobs = c.new_token_ids, so.logprobs
        if sample.detok is not None:
            text_ids = new_ids
            if c.finish_reason == "stop" and isinstance(c.stop_reason, int):
                text_ids = text_ids[:-1]  # the eos / stop token itself is not text
            before = len(sample.detok.output_token_ids)
            sample.detok.update(text_ids)
            if sample.detok.finished:  # a stop string ended at one of these tokens: the rest never happened
                kept = len(sample.detok.output_token_ids) - before  # (more than one: accepted draft tokens)
                new_ids, logprobs = new_ids[:kept], logprobs[:kept]
                stopped = not c.finish_reason  # else the core has finished it already
                c.finish_reason, c.stop_reason = "stop", sample.detok.stop_reason  # as in vLLM: the string wins
            if c.finish_reason:
                sample.detok.flush()
            o.text = sample.detok.output_text
        o.token_ids.extend(new_ids)
        if o.logprobs is not None:
            for lp in logprobs:
                o.logprobs.append(self._position(lp))
                o.cumulative_logprob = (o.cumulative_logprob or 0.0) + lp.logprob
        if c.finish_reason:
            o.finish_reason, o.stop_reason, o.error = c.finish_reason, c.stop_reason, c.error
            del self._samples[c.request_id]
        return stopped

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        dec = (lambda t: self.tokenizer.decode([t])) if self.tokenizer else (lambda t: None)
        pos = {t: Logprob(v, i + 1, dec(t)) for i, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        pos[lp.token_id] = Logprob(lp.logprob, lp.rank, dec(lp.token_id))
        return pos
