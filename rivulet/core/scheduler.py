"""The scheduler: picks, each step, one flat batch of prefill chunks and decode tokens."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from rivulet.config import RivuletError, SchedulerConfig
from rivulet.core.kv_cache_manager import KVCacheManager
from rivulet.core.kv_tier import KVTier
from rivulet.core.outputs import CachedRequestData, EngineCoreOutput, NewRequestData, SchedulerOutput
from rivulet.core.request import Request, RequestStatus
from rivulet.core.request_queue import RequestQueue
from rivulet.core.tier_loads import TierLoads


@dataclass
class SchedulerStats:
    """A snapshot for metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class Scheduler:
    """Token-budget scheduler with chunked prefill, priorities and preemption by recompute.

    Use: ``add_request`` any time; each step ``out = schedule()``, run the model on
    ``out``, then ``update_from_output(out, sampled)`` -- call it even when ``out`` is
    empty, since it also delivers requests the scheduler finished with an error.

    ``schedule()`` advances each scheduled request's ``num_computed_tokens`` and counts the
    token the step will sample as a placeholder, so the next ``schedule()`` may come before
    this step's ``update_from_output`` (async scheduling: at most one step in flight ahead of
    the updates); a request whose in-flight token surely ends it (its last allowed token) is
    not scheduled again. Called strictly in turn, it behaves as a synchronous scheduler.

    With a KV tier, a waiting request whose next blocks are in host memory or on disk waits for them to be
    loaded (``TierLoads``; the worker's reports come in through ``update_kv_tier``).
    """

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 num_lookahead_tokens: int = 0, kv_tier: KVTier | None = None, max_loras: int = 0) -> None:
        cfg = scheduler_config
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(cfg, name) < 1:
                raise RivuletError(f"SchedulerConfig.{name} must be >= 1, got {getattr(cfg, name)}")
        if (cfg.long_prefill_token_threshold or 0) < 0:
            raise RivuletError(f"long_prefill_token_threshold must be >= 0, got {cfg.long_prefill_token_threshold}")
        self._long_prefill = cfg.long_prefill_token_threshold or 0
        self._step_prefill = 0  # prefill tokens in the step being built
        self._step_long = False  # it holds a long prompt's chunk
        self.config = cfg
        self.kv_cache_manager = kv_cache_manager
        # blocks beyond a sampling step's tokens, where a draft model writes its guesses (its k drafts)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_loras = max_loras  # LoRA: different adapters among running requests at most (their slots)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = RequestQueue()  # WAITING and PREEMPTED
        self.running = RequestQueue()  # RUNNING: holds blocks
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()  # since the last schedule()
        self._error_outputs: list[EngineCoreOutput] = []  # not yet returned
        self.kv_tier = kv_tier if kv_tier is not None and kv_tier.enabled else None
        self.tier_loads = TierLoads(self.kv_tier, kv_cache_manager) if self.kv_tier is not None else None
        # WAITING_FOR_KV (or finished meanwhile) until the load reports
        self.loading: dict[str, Request] = self.tier_loads.loading if self.tier_loads is not None else {}

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises RivuletError if it is malformed or too long."""
        rid, max_len = request.request_id, self.config.max_model_len
        if rid in self.requests:
            raise RivuletError(f"request id {rid!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise RivuletError(f"request {rid!r}: the prompt is empty")
        if request.is_pooling:
            self._check_pooling(request)
        elif request.max_tokens < 1:
            raise RivuletError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
        elif request.num_prompt_tokens + request.max_tokens > max_len:
            raise RivuletError(
                f"request {rid!r}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) = {request.num_prompt_tokens + request.max_tokens} "
                f"exceeds max_model_len ({max_len})"
            )
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.add(request)

    def _check_pooling(self, request: Request) -> None:
        """An embedding's prompt is computed in one step: it must fit the context and the step's budget."""
        n, cfg = request.num_prompt_tokens, self.config
        if n > cfg.max_model_len:
            raise RivuletError(f"request {request.request_id!r}: the input ({n} tokens) exceeds max_model_len "
                               f"({cfg.max_model_len})")
        if n > cfg.max_num_batched_tokens:
            raise RivuletError(f"request {request.request_id!r}: the input ({n} tokens) exceeds "
                               f"max_num_batched_tokens ({cfg.max_num_batched_tokens}), the most one step computes")

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests in any state; unknown or already finished ids are ignored."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (e.g. a stop string matched); frees their blocks."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._remove_from_queue(req)
            self._release(req, status)

    def has_unfinished_requests(self) -> bool:
        """Requests left, or KV tier loads whose report is due."""
        return bool(self.requests) or bool(self.loading)

    def has_finished_to_report(self) -> bool:
        """Requests finished since the last schedule(), which the runner has yet to drop."""
        return bool(self._finished_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(1 for r in self.loading.values() if not r.is_finished)

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            len(self.running), self.num_waiting, kv.usage, kv.stats.queries, kv.stats.hits,
            self.num_preemptions,
        )

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        """Build the next flat batch: running requests first, then admissions."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        self._step_prefill, self._step_long = 0, False
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_request_ids:  # memory is short: admit nobody this step
            budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        if self.kv_tier is not None:
            out.kv_saves, out.kv_deletes = self.kv_tier.take_ops()
        return out

    def _prefill_chunk(self, req: Request, remaining: int, room: int) -> int:
        """How many of `req`'s `remaining` prompt tokens this step computes in `room` tokens of budget. All
        that fit, except around a long prompt (more than `long_prefill_token_threshold` left): a step that
        holds its chunk computes at most the threshold's prefill tokens in all, so long prompts go one
        after another. An embedding's input is never cut (it is computed whole)."""
        n = min(remaining, room)
        cap = self._long_prefill
        if cap and not req.is_pooling and (self._step_long or remaining > cap):
            self._step_long = True
            n = max(0, min(n, cap - self._step_prefill))
        return n

    def _remaining(self, req: Request) -> int:
        """Tokens to compute before `req` samples again (1: a decode)."""
        return req.num_tokens + req.num_output_placeholders - req.num_computed_tokens

    def _ends_in_flight(self, req: Request) -> bool:
        """The token a step in flight will sample is `req`'s last allowed one."""
        p = req.num_output_placeholders
        return p > 0 and (req.num_output_tokens + p >= req.max_tokens
                          or req.num_tokens + p >= self.config.max_model_len)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running request, in service order, a decode token (plus its draft tokens)
        or a prefill chunk.

        Prefill chunks and draft tokens leave one token of budget for every decode behind
        them, so a long prompt never holds back the decodes of other requests.
        """
        decodes_left = sum(1 for r in self.running if self._remaining(r) == 1 and not self._ends_in_flight(r))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._ends_in_flight(req):
                i += 1
                continue
            remaining = self._remaining(req)
            spec: list[int] = []
            if remaining == 1:
                decodes_left -= 1
                if req.spec_token_ids and req.num_output_placeholders == 0:
                    room = min(req.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens)
                    spec = req.spec_token_ids[:max(0, min(room - 1, budget - 1 - decodes_left))]
                num_new = 1 + len(spec)
            else:
                num_new = self._prefill_chunk(req, remaining, budget - decodes_left)
                if num_new <= 0:
                    i += 1
                    continue
            num_preempted = len(out.preempted_request_ids)
            new_block_ids = self._allocate_or_preempt(req, num_new, i, out)
            if new_block_ids is None:
                break  # req itself left the queue, and it was the last one
            if len(out.preempted_request_ids) != num_preempted:  # victims left from behind
                decodes_left = sum(
                    1 for r in self.running.after(i) if self._remaining(r) == 1 and not self._ends_in_flight(r)
                )
            out.cached_requests.append(
                CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens)
            )
            if spec:
                out.scheduled_spec_tokens[req.request_id] = spec
            elif remaining > 1:
                self._step_prefill += num_new
            self._scheduled(req, num_new, len(spec), out)
            budget -= num_new
            i += 1
        return budget

    def _scheduled(self, req: Request, num_new: int, num_spec: int, out: SchedulerOutput) -> None:
        """Record `num_new` tokens of `req` in this step and advance its progress."""
        out.num_scheduled_tokens[req.request_id] = num_new
        req.spec_token_ids = []
        samples = req.num_computed_tokens + num_new - num_spec == req.num_tokens + req.num_output_placeholders
        req.num_computed_tokens += num_new
        if req.is_pooling:  # whole, so pooled this step; finished by the update (no placeholder: never again)
            out.pooling_request_ids.add(req.request_id)
        elif samples:
            req.num_output_placeholders += 1
            out.sampling_request_ids.add(req.request_id)

    def _lookahead(self, req: Request, computed_after: int) -> int:
        """Scratch slots after a step that samples (none for a prefill chunk), within max_model_len."""
        if not self.num_lookahead_tokens or computed_after < req.num_tokens + req.num_output_placeholders:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.config.max_model_len - computed_after))

    def _allocate_or_preempt(
        self, req: Request, num_new: int, index: int, out: SchedulerOutput
    ) -> list[int] | None:
        """Allocate for running ``req``, preempting from the back of the queue as needed.

        Returns None if ``req`` itself had to go (preempted, or failed as too big).
        """
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(
                req, num_new, num_lookahead_tokens=self._lookahead(req, req.num_computed_tokens + num_new))
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop_back()
            if victim is req and index == 0:  # alone with the whole cache and still short
                self._fail_too_big(req, req.num_computed_tokens + num_new)
                return None
            self._preempt(victim, out)
            if victim is req:
                return None

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in service order while budget, seq cap and blocks allow."""
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_output_placeholders:  # preempted with a token still in flight: it arrives first
                break
            if req.lora is not None and not self._adapter_fits(req.lora.lora_int_id):
                break  # every adapter slot is held by running requests: the head waits for one
            if kv.num_blocks_for(req.num_tokens) > kv.num_blocks:
                self.waiting.pop_front()
                self._fail_too_big(req, req.num_tokens)
                continue
            hit_ids, num_hit = kv.get_computed_blocks(req)
            if self.tier_loads is not None and req.use_prefix_cache and not req.skip_kv_tier:
                found = self.tier_loads.lookup(req, num_hit)
                if found is None:
                    break  # some of its blocks are being loaded for another request: they come first
                if found:
                    if not self.tier_loads.start(req, hit_ids, num_hit, found, out):
                        break  # no device blocks for them yet
                    self.waiting.pop_front()
                    continue
            num_new = self._prefill_chunk(req, req.num_tokens - num_hit, budget)
            if num_new <= 0:
                break  # a long prompt waits for a step without other prefill; nobody overtakes it
            if req.is_pooling and num_new < req.num_tokens - num_hit:
                break  # an embedding is computed whole: it waits for a step with room for all of it
            if kv.allocate_slots(req, num_new, hit_ids, self._lookahead(req, num_hit + num_new)) is None:
                break  # the head waits for memory; nobody overtakes it
            self.waiting.pop_front()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.time()
            self.running.add(req)
            out.new_requests.append(
                NewRequestData(
                    req.request_id, list(req.all_token_ids), req.num_prompt_tokens,
                    kv.get_block_ids(req.request_id), num_hit, req.sampling_params, req.lora,
                    req.pooling_params,
                )
            )
            self._scheduled(req, num_new, 0, out)
            self._step_prefill += num_new
            budget -= num_new
        return budget

    def _adapter_fits(self, lora_id: int) -> bool:
        running = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        running |= {r.lora.lora_int_id for r in self.loading.values() if r.lora is not None}
        return lora_id in running or len(running) < self.max_loras

    def update_kv_tier(self, loaded: dict[str, int], dropped: list[str], disk_error: str | None = None) -> None:
        """Take the worker's KV tier report (`TierLoads.report`): loaded requests wait again."""
        if self.tier_loads is not None:
            for req in self.tier_loads.report(loaded, dropped, disk_error):
                self.waiting.add(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Drop ``req``'s KV (it is recomputed later) and put it back in the waiting queue."""
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req)
        out.preempted_request_ids.add(req.request_id)

    def _fail_too_big(self, req: Request, num_tokens: int) -> None:
        """Finish a request (already out of its queue) that can never fit in the cache."""
        kv = self.kv_cache_manager
        self._fail(
            req,
            f"request {req.request_id!r} needs {kv.num_blocks_for(num_tokens)} KV cache blocks "
            f"({num_tokens} tokens at block size {kv.block_size}) but the whole cache has "
            f"only {kv.num_blocks} blocks",
        )

    def _fail(self, req: Request, error: str) -> None:
        """Finish ``req`` with FINISHED_ERROR; its output goes out with the next update."""
        req.error = error
        self._release(req, RequestStatus.FINISHED_ERROR)
        self._error_outputs.append(
            EngineCoreOutput(
                req.request_id, [], "error", num_cached_tokens=max(req.num_cached_tokens, 0),
                error=error,
            )
        )

    def _release(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and free blocks; the caller has taken ``req`` out of its queue."""
        req.status = status
        if req.request_id not in self.loading:  # a load writes into the blocks of a loading one: freed on its report
            self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)

    # ---- results of a step ----

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]],
        pooled: dict[str, bytes] | None = None,
    ) -> list[EngineCoreOutput]:
        """Take a step's sampled tokens: append them, apply stop conditions, free finished.
        Embedding requests of the step finish with their ``pooled`` result.

        ``sampled_token_ids`` needs entries for the step's ``sampling_request_ids`` (tokens
        given for other requests are ignored): one token each, or for a request with draft
        tokens the accepted drafts plus one. A request preempted after this step was
        scheduled still takes its token (it was computed from the right KV).
        """
        outputs: list[EngineCoreOutput] = []
        finished_any = False
        for rid in scheduler_output.pooling_request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue  # aborted since the step was scheduled
            self._remove_from_queue(req)
            result = (pooled or {}).get(rid)
            if result is None:  # a runner bug; finishing beats waiting forever
                self._fail(req, f"request {rid!r}: the model runner returned no pooled output")
                continue
            self._release(req, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(rid, [], "stop", num_cached_tokens=max(req.num_cached_tokens, 0),
                                            pooled=result, scheduled_time=req.first_scheduled_time))
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or rid not in scheduler_output.sampling_request_ids:
                continue  # finished or aborted since the step was scheduled, or mid-prefill
            req.num_output_placeholders -= 1
            new_ids = sampled_token_ids.get(rid)
            spec = scheduler_output.scheduled_spec_tokens.get(rid, ())
            if not new_ids or len(new_ids) > len(spec) + 1:  # a runner bug; finishing beats waiting forever
                self._remove_from_queue(req)
                got = f"{len(new_ids)} tokens for {len(spec)} drafts" if new_ids else "no token"
                self._fail(req, f"request {rid!r}: the model runner returned {got}")
                finished_any = True
                continue
            running = req.status == RequestStatus.RUNNING
            if running:
                req.num_computed_tokens -= len(spec) + 1 - len(new_ids)  # the rejected drafts' KV is void
            for k, token_id in enumerate(new_ids):
                req.append_output_token_id(token_id)
                if self._check_stop(req):
                    new_ids = new_ids[: k + 1]
                    break
            first = req.num_output_tokens == len(new_ids)  # its first tokens: when it was scheduled goes too
            outputs.append(
                EngineCoreOutput(
                    rid, list(new_ids), req.status.finish_reason, req.stop_reason,
                    max(req.num_cached_tokens, 0), scheduled_time=req.first_scheduled_time if first else None,
                )
            )
            if req.status.is_finished:
                finished_any = True
                if not running:  # preempted meanwhile: it waits in the other queue
                    self.waiting.remove(req)
                self._release(req, req.status)
        if finished_any:
            self.running.retain(lambda r: r.status == RequestStatus.RUNNING)
        outputs.extend(self._error_outputs)
        self._error_outputs = []
        return outputs

    def _remove_from_queue(self, req: Request) -> None:
        if req.status == RequestStatus.WAITING_FOR_KV:
            return  # in self.loading until its load reports
        (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)

    def _check_stop(self, req: Request) -> bool:
        """Set a finished status if the last token ends ``req``; EOS/stop ids wait for min_tokens, unless the
        request's grammar ended with it (the sampler lets a grammar that allows only its end end the output)."""
        token_id = req.output_token_ids[-1]
        long_enough = req.num_output_tokens >= req.min_tokens
        if token_id in req.eos_token_ids and (long_enough or (req.grammar is not None and req.grammar.ended)):
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if long_enough:
            if token_id in req.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token_id
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
