"""A scripted in-process stand-in for AsyncLLM with the same interface (``EngineClient``), for fast
tests of the HTTP layer: deterministic tokens, adjustable speed, and a switch that kills it."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from rivulet.config import RivuletError
from rivulet.engine.outputs import CompletionOutput, Logprob, ModelInfo, RequestOutput
from rivulet.entrypoints.openai.engine_client import EngineDeadError
from rivulet.sampling_params import SamplingParams


class _Processor:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, list):
            return None, list(prompt)
        return prompt, list(self.tokenizer(prompt).input_ids)


class FakeEngine:
    """Generates ``script`` tokens (cycled) for every choice, one per ``step_delay`` seconds.

    Each sampled token has logprob -0.5 (rank 1); the runner-up has -inf, to check JSON safety.
    ``kill()`` makes every stream fail with EngineDeadError, as when the engine process dies.
    """

    def __init__(self, tokenizer: Any, script: list[int], step_delay: float = 0.0, max_model_len: int = 256) -> None:
        self.tokenizer = tokenizer
        self.model_info = ModelInfo(vocab_size=len(tokenizer), max_model_len=max_model_len, eos_token_ids={0})
        self.processor = _Processor(tokenizer, len(tokenizer))
        self.script = script
        self.step_delay = step_delay
        self.unfinished: set[str] = set()
        self.aborted: list[str] = []
        self.dead = False
        self._killed = asyncio.Event()

    @property
    def is_healthy(self) -> bool:
        return not self.dead

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.unfinished)

    def kill(self) -> None:
        self.dead = True
        self._killed.set()

    async def get_stats(self) -> dict[str, Any]:
        if self.dead:
            raise EngineDeadError("dead")
        n = len(self.unfinished)
        return {"num_running": n, "num_waiting": 0, "kv_cache_usage": 0.1 * n, "prefix_cache_queries": 10,
                "prefix_cache_hits": 5, "num_preemptions": 0, "num_blocks": 100}

    async def abort(self, request_id: str) -> None:
        self.unfinished.discard(request_id)

    async def shutdown(self) -> None:
        self.kill()

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        self.last_lora = lora_request
        if self.dead:
            raise EngineDeadError("the engine process exited")
        text, ids = self.processor.tokenize_prompt(prompt)
        if any(not 0 <= t < self.model_info.vocab_size for t in ids):
            raise RivuletError("token id outside the vocabulary")
        max_tokens = params.max_tokens or self.model_info.max_model_len - len(ids)
        if len(ids) + max_tokens > self.model_info.max_model_len:
            raise RivuletError(f"this model's maximum context length is {self.model_info.max_model_len} tokens")
        out = RequestOutput(request_id, text, ids,
                            [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                             for i in range(params.n)])
        if params.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + [{t: Logprob(-1.0, 1, self.tokenizer.decode([t]))} for t in ids[1:]]
        self.unfinished.add(request_id)
        finished = False
        try:
            for step in range(max_tokens):
                await self._step()
                token = self.script[step % len(self.script)]
                for c in out.outputs:
                    c.token_ids.append(token)
                    c.text = self.tokenizer.decode(c.token_ids)
                    if c.logprobs is not None:
                        c.logprobs.append({token: Logprob(-0.5, 1, self.tokenizer.decode([token])),
                                           token + 1: Logprob(float("-inf"), 2, self.tokenizer.decode([token + 1]))})
                    if step == max_tokens - 1:
                        c.finish_reason = "length"
                finished = step == max_tokens - 1
                yield out
        finally:
            self.unfinished.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    async def _step(self) -> None:
        if self.dead:
            raise EngineDeadError("the engine process exited")
        killed = asyncio.ensure_future(self._killed.wait())
        try:
            await asyncio.wait({killed}, timeout=self.step_delay)
        finally:
            killed.cancel()
        if self.dead:
            raise EngineDeadError("the engine process exited")
