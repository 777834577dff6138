"""EngineCore: the loop of scheduler.schedule() -> executor.execute() -> scheduler.update().

With async scheduling (the default where the device computes apart from the host: CUDA, not CPU,
whose cores the forward pass itself uses) a step runs in a worker thread while this thread schedules
the next one and then processes the finished one's outputs:

    main thread:    schedule N+1 | wait for N | update N, outputs of N -> caller | schedule N+2 | ...
    worker thread:  ... execute N ............| execute N+1 ......................| execute N+2

so the forward pass of step N+1 starts as soon as step N's ends, and the scheduler, the
stop checks, detokenization and message encoding of step N overlap it. Step N+1 is scheduled
before step N's tokens are known: each running request gets one token whose input is the one
step N samples (the scheduler counts it as a placeholder; the runner reads it on the device, and its
step returns before the tokens reach the host: `resolve` waits for them, `worker/async_output.py`). Greedy outputs
are the synchronous loop's; a request that step N finishes wastes its slot in step N+1.
With speculative decoding the loop runs synchronously (drafts need the last token).

Structured output: a step with constrained rows asks for its grammar bitmask only after its forward
pass (`execute(..., grammar_bitmask)`), so the mask is filled meanwhile: synchronously in the step
thread (the forward stays on this one); asynchronously on this thread, once step N's tokens have moved
the matchers, while step N+1's forward runs:

    main thread:    schedule N+1 | wait for N | update N (matchers take N's tokens) | mask of N+1 | ...
    worker thread:  ... execute N ............| forward N+1 ..................................| sample N+1
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor

from rivulet.config import EngineConfig, RivuletError
from rivulet.core import KVCacheManager, Scheduler
from rivulet.core.kv_tier import FILE_OVERHEAD, KVTier
from rivulet.core.outputs import EngineCoreOutput, SchedulerOutput
from rivulet.core.request import Request, RequestStatus
from rivulet.engine.outputs import ModelInfo, StepOutput
from rivulet.engine.tokenizer import eos_token_ids, load_tokenizer
from rivulet.executor import make_executor
from rivulet.models.arch_config import ArchConfig
from rivulet.models.loader import ModelSource
from rivulet.models.loader.pooling import read_pooler_config
from rivulet.platforms import current_platform
from rivulet.spec_decode import NgramProposer, SpecDecodeStats
from rivulet.structured import StructuredOutputManager
from rivulet.worker.async_output import AsyncModelRunnerOutput, resolve
from rivulet.worker.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)

DEFAULT_DISK_TIER_BYTES = 8 << 30


def kv_namespace(config: EngineConfig, source: ModelSource) -> bytes:
    """The model's identity in every KV block key: its weights files and what changes the numbers the
    KV cache holds (dtype, quantization, dummy weights' seed)."""
    m = config.model
    ident = f"{source.fingerprint()}|{m.dtype}|{m.quantization}|{m.load_format}|{m.seed if m.load_format == 'dummy' else ''}"
    if config.cache.cache_dtype != "auto":  # (the auto identities stay as they were: saved tiers remain valid)
        ident += f"|kv:{config.cache.cache_dtype}"
    return hashlib.sha256(ident.encode()).digest()


def check_kv_tier(config: EngineConfig) -> None:
    """What the KV tier cannot run with (yet), said before anything is loaded."""
    if not config.cache.kv_tier_enabled:
        return
    if not config.cache.enable_prefix_caching:
        raise RivuletError("the KV tier (--kv-offload-memory, --kv-tier-path) keeps prefix-cache blocks: "
                           "it needs prefix caching (drop --no-enable-prefix-caching)")


def check_task(config: EngineConfig, arch: ArchConfig) -> None:
    """An embedding engine pools whole prompts: nothing it has to sample, cache or adapt."""
    if config.model.task == "generate":
        if arch.is_encoder:
            raise RivuletError(f"{arch.architecture} is an encoder: it serves embeddings, start it with --task embed")
        return
    for on, what in ((config.speculative, "speculative decoding"), (config.lora, "LoRA adapters"),
                     (config.cache.kv_tier_enabled, "the KV tier")):
        if on:
            raise RivuletError(f"--task embed runs without {what}")


@dataclasses.dataclass
class _Launched:
    """A step handed to the executor: its outputs to come, and the grammar bitmask it waits for after its
    forward pass (None for a step with no constrained row), which the engine thread fills."""

    sched: SchedulerOutput
    result: Future[ModelRunnerOutput | AsyncModelRunnerOutput]
    mask: Future[bytes | None] | None = None


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        if config.parallel.data_parallel_size != 1:
            raise RivuletError("--data-parallel-size runs replicas behind `rivulet serve`; one engine (and the "
                               "offline LLM) is one replica")
        check_kv_tier(config)
        self.executor = make_executor(config, source)
        try:
            self._setup(config, source)
        except BaseException:
            self.executor.shutdown()
            raise

    def _setup(self, config: EngineConfig, source: ModelSource) -> None:
        arch = self.executor.arch_config
        check_task(config, arch)
        self.pooler = read_pooler_config(source, arch.is_encoder, config.model.pooler_config) \
            if config.model.task == "embed" else None
        # an embedding model's default length is the one it was trained to embed (sentence-transformers')
        default_len = (self.pooler.max_seq_length if self.pooler else None) or arch.max_position_embeddings
        model_len = config.model.max_model_len or min(default_len, arch.max_position_embeddings)
        if model_len > arch.max_position_embeddings:
            raise RivuletError(f"max_model_len {model_len} exceeds the model's context length "
                               f"({arch.max_position_embeddings})")
        long_prefill = config.scheduler.long_prefill_token_threshold
        if long_prefill is None:
            long_prefill = current_platform().long_prefill_token_threshold or 0
        # configs are frozen: the core keeps a copy whose scheduler knows the model's length
        self.config = config = dataclasses.replace(config, scheduler=dataclasses.replace(
            config.scheduler, max_model_len=model_len, long_prefill_token_threshold=long_prefill))
        num_blocks = self.executor.determine_num_blocks()
        bs = config.cache.block_size
        if num_blocks * bs < model_len:
            raise RivuletError(f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks), fewer than "
                               f"max_model_len {model_len}: give it more memory or lower max_model_len")
        namespace = kv_namespace(config, source)
        tier = self._make_kv_tier(config, namespace)
        self.executor.initialize_cache(num_blocks, tier.host_slots if tier else 0,
                                       str(tier.disk_dir) if tier and tier.disk_dir else None)
        self.num_blocks = num_blocks
        block_bytes = self.executor.kv_bytes_per_block()
        latent = f"; MLA latent cache, {arch.mla_cache_saving():.1f}x smaller than the heads' keys and values" \
            if arch.is_mla else ""
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %d bytes per token%s); max_model_len %d",
                    num_blocks, bs, num_blocks * bs, num_blocks * block_bytes / 2**20, block_bytes // bs, latent,
                    model_len)
        self.kv_cache_manager = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching, namespace)
        spec = config.speculative
        # a draft model writes its guesses after a sampling step's tokens: room for them
        lookahead = spec.num_speculative_tokens if spec and spec.method == "draft_model" else 0
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, lookahead, tier,
                                   config.lora.max_loras if config.lora else 0)
        # the tokenizer lives with the front end; the config files give the end-of-sequence ids here
        self.eos_token_ids = eos_token_ids(source, arch.eos_token_ids, None)
        self.executor.set_eos_token_ids(self.eos_token_ids)
        use_async = config.scheduler.async_scheduling
        if use_async is None:
            use_async = current_platform().computes_apart_from_host
        self.async_scheduling = use_async
        # async steps return before their tokens reach the host; the next step reads them on the device
        self.executor.use_async_outputs(use_async and spec is None)
        # synchronous steps fill the grammar bitmask in the step thread during the forward pass where the
        # device computes apart from the host; on CPU the forward's thread team has every core, and a
        # fill beside it measured slower than one before it (benchmarks/RESULTS.md, structured output)
        self.overlap_grammar = current_platform().computes_apart_from_host
        # runs a step while this thread schedules the next one (async) or fills the step's grammar bitmask
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rivulet-step")
        self._in_flight: _Launched | None = None
        # draft tokens for a decoding request (k-token steps): the n-gram proposer (or a test's) here, before
        # each schedule; a draft model's come with each step's output from the runner
        self.speculative = spec is not None
        self.proposer: Callable[[Request], list[int]] | None = \
            NgramProposer(spec) if spec and spec.method == "ngram" else None
        self.spec_disable_batch_size = spec.disable_by_batch_size if spec else None
        self.spec_stats = SpecDecodeStats()
        # structured output: requests wait here while their grammar compiles, then join the scheduler
        self.structured = StructuredOutputManager(lambda: load_tokenizer(source, config.model.tokenizer),
                                                  arch.vocab_size)

    def _make_kv_tier(self, config: EngineConfig, namespace: bytes) -> KVTier | None:
        """The KV tier's index, sized from the flags in blocks (None without a tier). The disk tier's
        files go to a subfolder named by the model's identity, so models can share one --kv-tier-path."""
        cc = config.cache
        if not cc.kv_tier_enabled:
            return None
        block_bytes = self.executor.kv_bytes_per_block()
        host_slots = (cc.kv_offload_memory or 0) // block_bytes
        disk_dir, disk_blocks = None, 0
        if cc.kv_tier_path is not None:
            # with several ranks each keeps the files of its own shard: this folder is rank 0's (the index),
            # rank r's is beside it with ".rank<r>" (`Worker.tier_folder`)
            pc = config.parallel
            layout = f"-tp{pc.tensor_parallel_size}-pp{pc.pipeline_parallel_size}" if pc.world_size > 1 else ""
            disk_dir = Path(cc.kv_tier_path).expanduser() / f"{namespace.hex()[:16]}-b{cc.block_size}{layout}"
            try:
                disk_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RivuletError(f"--kv-tier-path: cannot create {disk_dir}: {e.strerror}") from None
            budget = cc.kv_tier_disk_bytes
            if budget is None:
                budget = min(DEFAULT_DISK_TIER_BYTES, int(shutil.disk_usage(disk_dir).free * 0.9))
            disk_blocks = budget // (block_bytes + FILE_OVERHEAD)
        tier = KVTier(host_slots, disk_dir, disk_blocks)
        logger.info("KV tier: %d blocks in host memory (%.1f MiB), %d on disk (%.2f GiB at %s, %d there already)",
                    host_slots, host_slots * block_bytes / 2**20, disk_blocks,
                    disk_blocks * (block_bytes + FILE_OVERHEAD) / 2**30, disk_dir, len(tier.disk))
        return tier

    def model_info(self) -> ModelInfo:
        arch = self.executor.arch_config
        return ModelInfo(arch.vocab_size, self.config.scheduler.max_model_len, set(self.eos_token_ids),
                         self.config.model.task, arch.hidden_size, bool(self.pooler and self.pooler.matryoshka))

    def get_stats(self) -> dict[str, Any]:
        """A snapshot for metrics: the scheduler's, the cache size, and speculative decoding's counters."""
        stats = dataclasses.asdict(self.scheduler.get_stats()) | {"num_blocks": self.num_blocks}
        if self.scheduler.kv_tier is not None:
            stats |= {f"kv_tier_{k}": v for k, v in dataclasses.asdict(self.scheduler.kv_tier.stats).items()}
            stats["kv_tier_block_bytes"] = self.executor.kv_bytes_per_block()
        if self.speculative or self.proposer is not None:
            stats |= {f"spec_decode_{k}": v for k, v in dataclasses.asdict(self.spec_stats).items()}
        return stats

    def shutdown(self) -> None:
        if self._in_flight is not None:
            self._fill_bitmask(self._in_flight)
            try:
                self._in_flight.result.result()
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
            self._in_flight = None
        self._pool.shutdown()
        self.structured.shutdown()
        self.executor.shutdown()

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if params is not None and params.structured_outputs is not None:
            self.structured.submit(request)  # to the scheduler once its grammar is compiled
        else:
            self.scheduler.add_request(request)

    def abort_requests(self, ids: list[str]) -> None:
        self.structured.abort(ids)
        self.scheduler.abort_requests(ids)
        self._release_if_idle()

    def finish_requests(self, ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(ids, status)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        """With no step to come, hand the runner the requests finished since the last one, so that it drops
        their rows (an idle engine holds nothing of a finished request)."""
        if self._in_flight is None and not self.scheduler.has_unfinished_requests() \
                and self.scheduler.has_finished_to_report():
            result = resolve(self.executor.execute(self.scheduler.schedule()))
            self.scheduler.update_kv_tier(result.kv_loaded, result.kv_dropped, result.kv_disk_error)

    def check_health(self) -> None:
        """Raise RivuletError if a part of the engine outside this process (a worker rank) is gone."""
        self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        """Requests left (some perhaps waiting for their grammar), or a step still running (its outputs are due)."""
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None
                or self.structured.num_waiting > 0)

    def step(self) -> list[StepOutput]:
        """Outputs of one step: the one just run (synchronous), or the one that was in flight (async;
        the first call of a run returns nothing and leaves its step running)."""
        failed = self._admit_compiled() if self.structured.num_waiting else []
        if not self.async_scheduling or self.speculative or self.proposer is not None:
            if self._in_flight is not None:  # switching to the synchronous loop: finish the step in flight
                return failed + self._finish(self._take_in_flight())
            if not self.scheduler.has_unfinished_requests():
                return failed
            self._propose()
            step = self._launch(self.scheduler.schedule())
            self._fill_bitmask(step)  # (launched in the step thread where async scheduling is on)
            return failed + self._finish(step)
        nxt = self._launch(self.scheduler.schedule()) if self.scheduler.has_unfinished_requests() else None
        done, self._in_flight = self._in_flight, nxt
        try:
            return failed + (self._finish(done) if done is not None else [])
        finally:
            if nxt is not None:  # the matchers have taken step N's tokens: step N+1's mask
                self._fill_bitmask(nxt)

    def drain(self) -> list[StepOutput]:
        """Wait for the step in flight, if any, and return its outputs (async scheduling)."""
        return self._finish(self._take_in_flight()) if self._in_flight is not None else []

    def _take_in_flight(self) -> _Launched:
        assert self._in_flight is not None
        step, self._in_flight = self._in_flight, None
        return step

    def _launch(self, sched: SchedulerOutput) -> _Launched:
        """Run `sched`: in the step thread (async), or here with its grammar bitmask filled in the step
        thread meanwhile (synchronous: the forward pass stays on this thread, with its CPU thread team)."""
        follows = sched.grammar_follows = self.structured.constrained(sched, self.scheduler.requests)
        if self.async_scheduling:
            mask: Future[bytes | None] | None = Future() if follows else None
            return _Launched(sched, self._pool.submit(self.executor.execute, sched, mask and mask.result), mask)
        if not follows:
            source = None
        elif self.overlap_grammar:
            source = self._pool.submit(self.structured.bitmask, sched, self.scheduler.requests).result
        else:
            data = self.structured.bitmask(sched, self.scheduler.requests)
            source = lambda: data  # noqa: E731
        done: Future[ModelRunnerOutput | AsyncModelRunnerOutput] = Future()
        done.set_result(self.executor.execute(sched, source))
        return _Launched(sched, done)

    def _fill_bitmask(self, step: _Launched) -> None:
        """Give an async `step` its grammar bitmask from the matchers as they are now; a failure here fails
        the step (it surfaces from its result), never leaves it waiting."""
        if step.mask is None or step.mask.done():
            return
        try:
            step.mask.set_result(self.structured.bitmask(step.sched, self.scheduler.requests))
        except BaseException as e:  # noqa: BLE001 - handed to the step
            step.mask.set_exception(e)

    def _admit_compiled(self) -> list[StepOutput]:
        """Queue the requests whose grammar is ready; error outputs for those whose grammar failed.
        An engine with nothing else to do waits a little for a grammar instead of spinning."""
        idle = not self.scheduler.has_unfinished_requests() and self._in_flight is None
        ready, failed = self.structured.take_ready(wait_s=0.05 if idle else 0.0)
        outs = [StepOutput(EngineCoreOutput(req.request_id, [], "error", error=msg)) for req, msg in failed]
        for req in ready:
            try:
                self.scheduler.add_request(req)
            except ValueError as e:
                outs.append(StepOutput(EngineCoreOutput(req.request_id, [], "error", error=str(e))))
        return outs

    def _constrained(self) -> bool:
        """Some request has a grammar (its matcher must take the step's tokens)."""
        return any(r.grammar is not None for r in self.scheduler.requests.values())

    def _propose(self) -> None:
        if self.proposer is None:
            return
        limit = self.spec_disable_batch_size
        if limit is not None and len(self.scheduler.running) > limit:
            return
        for req in self.scheduler.running:
            if req.num_tokens - req.num_computed_tokens == 1 and not req.num_output_placeholders \
                    and _may_draft(req):
                req.spec_token_ids = list(self.proposer(req))

    def _finish(self, step: _Launched) -> list[StepOutput]:
        sched, result = step.sched, resolve(step.result.result())  # (waits for the tokens of an async output)
        for rid, spec in sched.scheduled_spec_tokens.items():
            got = result.sampled_token_ids.get(rid)
            if got:
                self.spec_stats.observe(len(spec), len(got) - 1)
        if self._constrained():  # matchers follow their tokens (also while one waits for its start tokens)
            for rid, toks in result.sampled_token_ids.items():
                req = self.scheduler.requests.get(rid)
                if req is not None and req.grammar is not None:
                    self.structured.accept(req, toks)
        self.scheduler.update_kv_tier(result.kv_loaded, result.kv_dropped, result.kv_disk_error)
        outputs = self.scheduler.update_from_output(sched, result.sampled_token_ids, result.pooled)
        for rid, drafts in result.draft_token_ids.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING and _may_draft(req):
                req.spec_token_ids = drafts
        self._release_if_idle()
        steps = [StepOutput(o, result.logprobs.get(o.request_id, []), result.prompt_logprobs.get(o.request_id))
                 for o in outputs]
        reported = {o.request_id for o in outputs}
        steps += [StepOutput(EngineCoreOutput(rid, []), [], lps)  # mid-prompt chunks: prompt logprobs only
                  for rid, lps in result.prompt_logprobs.items() if rid not in reported]
        return steps


def _may_draft(req: Request) -> bool:
    """Drafts are verified under a grammar that is on (each draft row masked after the drafts before it);
    a grammar still waiting for its start tokens could start inside the drafts, so none then."""
    return req.grammar is None or req.grammar.active
