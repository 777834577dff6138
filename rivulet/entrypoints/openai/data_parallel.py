"""``rivulet serve --data-parallel-size N``: N engine processes (replicas) behind one API server.

Each replica is a ``SupervisedEngine`` (restarted when it dies) on its own share of the CPU cores. A request
goes to a replica chosen by the router's policies (`rivulet/router/policies.py`, cache-aware by default: the
replica that saw the longest prefix of the request's text, unless load is imbalanced). When a replica dies
under a request, the request goes on on another replica: not started yet, it starts there; mid-way (one
sample, no logprobs or grammar), it resumes as prompt + the tokens already produced (the remaining
``max_tokens``, the same seed: seeded draws are keyed on position), and its outputs keep counting from
where they were, so the client sees one answer. Otherwise its stream fails with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator, Callable

from rivulet.config import EngineConfig
from rivulet.engine.async_llm import EngineDeadError
from rivulet.engine.outputs import CompletionOutput, ModelInfo, RequestOutput
from rivulet.entrypoints.openai.supervisor import SupervisedEngine
from rivulet.lora_request import LoRARequest
from rivulet.router.policies import Policy, RouteInput
from rivulet.router.workers import Worker
from rivulet.sampling_params import SamplingParams

logger = logging.getLogger("rivulet.server")


def replica_configs(config: EngineConfig, n: int, cpus: list[int]) -> list[EngineConfig]:
    """`config` for each of `n` replicas, each pinned to its share of `cpus` (all of them when fewer than n)."""
    share = max(1, len(cpus) // n)
    out = []
    for i in range(n):
        mine = cpus[i * share:(i + 1) * share] if len(cpus) >= n else cpus
        out.append(dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, cpus=list(mine),
                                                                             data_parallel_size=1)))
    return out


class DataParallelEngine:
    """The ``EngineClient`` of a server with several replicas."""

    def __init__(self, replicas: list[SupervisedEngine], policy: Policy) -> None:
        self.replicas = replicas
        self.workers = [Worker(f"engine-{i}") for i in range(len(replicas))]  # the policy's view: in-flight counts
        self.policy = policy
        self.spawned_at = min(r.spawned_at for r in replicas)
        self.resumed = 0  # requests resumed on another replica

    async def ready(self) -> DataParallelEngine:
        await asyncio.gather(*(r.ready() for r in self.replicas))
        return self

    # ---- state ----

    @property
    def tokenizer(self) -> Any:
        return self.replicas[0].tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.replicas[0].model_info

    @property
    def processor(self) -> Any:
        return self.replicas[0].processor

    @property
    def is_healthy(self) -> bool:
        return any(r.is_healthy for r in self.replicas)

    @property
    def restarting(self) -> bool:
        return not self.is_healthy and any(r.restarting for r in self.replicas)

    @property
    def fatal(self) -> str | None:
        return next((r.fatal for r in self.replicas if r.fatal), None)

    @property
    def on_fatal(self) -> Callable[[str], None]:
        return self.replicas[0].on_fatal

    @on_fatal.setter
    def on_fatal(self, fn: Callable[[str], None]) -> None:  # one replica past its restarts ends the server
        for r in self.replicas:
            r.on_fatal = fn

    @property
    def num_unfinished_requests(self) -> int:
        return sum(r.num_unfinished_requests for r in self.replicas if r.is_healthy)

    # ---- requests ----

    def _choose(self, text: str, exclude: set[int]) -> int:
        ok = [i for i, r in enumerate(self.replicas) if r.is_healthy and i not in exclude]
        if not ok:
            raise EngineDeadError("no engine replica is running")
        route = RouteInput(text)
        w = self.policy.choose([self.workers[i] for i in ok], route)
        self.policy.routed(w, route)
        return self.workers.index(w)

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        text, original = _route_text(prompt), params
        tried: set[int] = set()
        last: RequestOutput | None = None  # what the client has been given
        attempt = 0
        while True:
            i = self._choose(text, tried)
            base = last if last is not None and last.outputs[0].token_ids else None  # resumed after these tokens
            if base is not None:
                sent = base.outputs[0].token_ids
                prompt = {"prompt_token_ids": base.prompt_token_ids + sent, "cache_salt": _salt(prompt)}
                params = _rest(original, len(sent))
            rid = request_id if attempt == 0 else f"{request_id}-r{attempt}"
            self.workers[i].in_flight += 1
            try:
                async for out in self.replicas[i].generate(prompt, params, rid, priority, lora_request):
                    last = out if base is None else _joined(base, out, request_id)
                    yield last
                return
            except EngineDeadError:
                if len(tried) + 1 >= len(self.replicas) or (last is not None and not _resumable(original)):
                    raise
                tried.add(i)
                attempt += 1
                self.resumed += 1
                logger.warning("request %s: replica %d died after %d tokens; going on on another replica", request_id,
                               i, len(last.outputs[0].token_ids) if last is not None else 0)
            finally:
                self.workers[i].in_flight -= 1

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(*(r.abort(request_id) for r in self.replicas if r.is_healthy))

    async def get_stats(self) -> dict[str, Any]:
        stats = await asyncio.gather(*(r.get_stats() for r in self.replicas if r.is_healthy))
        return merge_stats(list(stats))

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas))


def merge_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot for the replicas: counts summed, the KV cache usage averaged."""
    out: dict[str, Any] = {}
    for s in stats:
        for k, v in s.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k in out:
                out[k] = max(out[k], v) if k == "kv_tier_block_bytes" else out[k] + v
            else:
                out.setdefault(k, v)
    if stats and "kv_cache_usage" in out:
        out["kv_cache_usage"] /= len(stats)
    return out


def _route_text(prompt: Any) -> str:
    if isinstance(prompt, dict):
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        return ",".join(map(str, prompt.get("prompt_token_ids") or []))
    return prompt if isinstance(prompt, str) else ",".join(map(str, prompt))


def _salt(prompt: Any) -> str | None:
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def _resumable(params: SamplingParams) -> bool:
    return params.n == 1 and params.logprobs is None and params.prompt_logprobs is None and \
        params.structured_outputs is None


def _rest(params: SamplingParams, done: int) -> SamplingParams:
    """`params` for the rest of a request that has produced `done` tokens."""
    return dataclasses.replace(params, max_tokens=max(1, params.max_tokens - done),
                               min_tokens=max(0, params.min_tokens - done))


def _joined(before: RequestOutput, after: RequestOutput, request_id: str) -> RequestOutput:
    """The original request's output: what it had when its replica died, then the resumed request's."""
    a, b = before.outputs[0], after.outputs[0]
    return RequestOutput(request_id, before.prompt, before.prompt_token_ids, [CompletionOutput(
        0, a.text + b.text, a.token_ids + b.token_ids, None, None, b.finish_reason, b.stop_reason, b.error)],
        before.prompt_logprobs, before.num_cached_tokens)
