"""Loads the model, owns the paged KV cache, and runs one flat batch per step."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from rivulet.config import CacheConfig, LoRAConfig, ModelConfig, RivuletError, SpeculativeConfig
from rivulet.core.outputs import GrammarBitmask, SchedulerOutput
from rivulet.distributed import get_parallel_state
from rivulet.layers.attention import Attention
from rivulet.layers.pooler import finish_embedding, pool
from rivulet.layers.sampler import Sampler, apply_token_bitmask, gather_logprobs
from rivulet.models.decode_program import DecodeProgram, build_decode_program
from rivulet.models.loader import ModelSource, load_model
from rivulet.models.loader.pooling import read_pooler_config
from rivulet.pooling_params import PoolingParams
from rivulet.platforms import current_platform
from rivulet.worker.async_output import AsyncModelRunnerOutput, AsyncSample
from rivulet.worker.batch import FlatBatch, SeqChunk, build_flat_batch
from rivulet.worker.cuda_graph import DEFAULT_BUCKETS, DecodeGraphs, StepGraphs, hidden_states, verify_buckets
from rivulet.worker.draft_runner import DraftRunner
from rivulet.worker.input_batch import InputBatch, StepInputs
from rivulet.worker.kv_tier import KVTierWorker
from rivulet.worker.lora import LoRAManager
from rivulet.worker.outputs import ModelRunnerOutput, TokenLogprobs
from rivulet.worker.pipeline import PipelineStage
from rivulet.worker.staging import to_device

logger = logging.getLogger(__name__)

ENCODER_BLOCKS = 1 << 14  # an encoder's "KV blocks": tokens in flight, nothing allocated

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    platform = current_platform()
    if name == "auto":
        return platform.default_dtype
    if name not in _DTYPES:
        raise RivuletError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    dtype = _DTYPES[name]
    if dtype not in platform.supported_dtypes():
        ok = ", ".join(str(d).removeprefix("torch.") for d in platform.supported_dtypes())
        raise RivuletError(f"dtype {name} is not supported on {platform.name}; use one of: {ok}")
    return dtype


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, source: ModelSource,
                 speculative: SpeculativeConfig | None = None, lora: LoRAConfig | None = None) -> None:
        self.platform = current_platform()
        self.device = self.platform.device
        self.dtype = resolve_dtype(model_config.dtype)
        self.cache_config = cache_config
        self.cache_dtype = self.dtype if cache_config.cache_dtype == "auto" else torch.float8_e5m2
        if self.cache_dtype != self.dtype:
            if self.platform.name != "cpu":
                raise RivuletError(f"--kv-cache-dtype {cache_config.cache_dtype} runs on CPUs for now "
                                   f"(not on {self.platform.name})")
            if model_config.compilation_level > 0:
                raise RivuletError(f"--kv-cache-dtype {cache_config.cache_dtype} runs with --compilation-level 0 "
                                   "for now")
        torch.manual_seed(model_config.seed)
        start = time.perf_counter()
        self.model, self.arch = load_model(model_config, source, self.dtype, self.device)
        loaded = time.perf_counter()
        self.platform.place_module(self.model)
        logger.info("model loaded in %.2f s (+%.2f s placing it in memory)", loaded - start,
                    time.perf_counter() - loaded)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if self.cache_dtype != self.dtype and self.arch.is_mla:
            raise RivuletError(f"--kv-cache-dtype {cache_config.cache_dtype}: not for latent attention (MLA) yet")
        self.kv_caches: list[torch.Tensor] = []
        self.kv_tier: KVTierWorker | None = None  # copies of the KV tier below the cache (host memory, files)
        self._idle_step = False  # the last step computed nothing: its report may wait for a tier load
        self.sampler = Sampler()
        self.batch = InputBatch(cache_config.block_size, self.arch.vocab_size, self.device)
        self._pending: tuple[StepInputs, torch.Tensor, torch.Tensor | None] | None = None
        # async outputs: a step's tokens go to the host without a wait (`use_async_outputs`); the rows of the
        # last such step and its copies, until the batch takes them (`_settle`)
        self.async_outputs = False
        self._unsettled: tuple[np.ndarray, AsyncSample] | None = None
        self.eos_token_ids: set[int] = set(self.arch.eos_token_ids)  # the engine may add more
        self.max_model_len = model_config.max_model_len or self.arch.max_position_embeddings
        # graphs need kernels that skip padding slots and never sync (the Triton ones), and one rank
        self.use_cuda_graphs = (self.platform.name == "cuda" and not model_config.enforce_eager
                                and self.platform.kernel_backend() == self.platform.attention_backend() == "triton"
                                and get_parallel_state().world_size == 1)
        self.cuda_graphs: StepGraphs | None = None
        # CPU: decode steps of a plain Llama decoder with int8/int4 weights as one native call (DecodeProgram)
        self.use_decode_program = self.platform.name == "cpu" and not model_config.enforce_eager
        self.decode_program: DecodeProgram | None = None
        self.decode_program_skipped: str | None = None  # why the model has none
        self.speculative = speculative
        self.lora: LoRAManager | None = None
        if lora is not None:
            self.lora = LoRAManager(self.model, lora, self.dtype, self.device)
            # the adapters' segments change from step to step: no CUDA graphs; the decode program (which has no
            # adapters) runs the steps in which no row has one
            self.use_cuda_graphs = False
        self.forward_fn = self.model  # the compiled forward at --compilation-level 1 and 2
        ps = get_parallel_state()
        # pipeline parallelism: the step's micro-batches, received and sent on around this stage's forward
        self.pipeline = PipelineStage(ps, self.arch.hidden_size, self.dtype) if ps.pp_size > 1 else None
        if model_config.compilation_level > 0:  # (`check_parallel` refuses PP with SP)
            from rivulet.compilation import CompiledForward, parse_passes  # inductor only when compiling

            passes = parse_passes(model_config.compilation_passes) if model_config.compilation_level == 2 else ()
            # with several ranks each compiles its own graphs in-process (no saved graphs: they would name this
            # process's collectives), and so does a model with LoRA slots (its graphs name this engine's slots)
            self.forward_fn = CompiledForward(self.model, cache=ps.world_size == 1 and self.lora is None,
                                              passes=passes)
        self.cuda_graph_error: str | None = None  # why capture failed (the runner then stays eager)
        self.drafter = None  # speculative decoding's draft model: proposes after each sampling step
        # --task embed: each request's hidden states pooled into one vector (its params by request id)
        self.pooler = read_pooler_config(source, self.arch.is_encoder, model_config.pooler_config) \
            if model_config.task == "embed" else None
        self._pooling: dict[str, PoolingParams] = {}
        if speculative is not None and speculative.method == "draft_model":
            self.drafter = DraftRunner(speculative, model_config, self.dtype, self.device, self.arch, self.max_model_len)

    def set_eos_token_ids(self, ids: set[int]) -> None:
        self.eos_token_ids = set(ids)

    def use_async_outputs(self, on: bool) -> None:
        """Let `execute` return before its sampled tokens reach the host (async scheduling: the engine reads
        them while the next step runs); not with a draft model, which proposes from them at once."""
        self.async_outputs = on and self.drafter is None

    def shutdown(self) -> None:
        if self.kv_tier is not None:
            self.kv_tier.shutdown()

    # ---- KV cache ----

    def _kv_layers(self) -> list[Attention]:
        """Layers with a KV cache: the model's, then the draft model's (which shares the block ids)."""
        return self.attn_layers + (self.drafter.attn_layers if self.drafter is not None else [])

    def kv_bytes_per_block(self) -> int:
        bs, size = self.cache_config.block_size, self.cache_dtype.itemsize
        return sum(a.kv_halves * bs * a.num_kv_heads * a.head_dim * size for a in self._kv_layers())

    def num_blocks_for_budget(self) -> int:
        """Blocks that fit the configured KV memory (or a share of the free memory); an encoder caches
        nothing, so its blocks are only the scheduler's count of tokens in flight."""
        cc = self.cache_config
        if cc.num_blocks is not None:
            return cc.num_blocks
        if not self._kv_layers():
            return ENCODER_BLOCKS
        budget = cc.kv_cache_memory
        if budget is None:
            budget = self.platform.kv_cache_budget(cc.memory_utilization)
        return max(budget // self.kv_bytes_per_block(), 0)

    def allocate_kv_cache(self, num_blocks: int, host_slots: int = 0, disk_dir: str | None = None) -> None:
        """The paged cache; with ``host_slots`` or ``disk_dir`` also the KV tier's copier below it."""
        bs = self.cache_config.block_size
        self.kv_caches = []
        for a in self._kv_layers():
            cache = self.platform.zeros((a.kv_halves, num_blocks, bs, a.num_kv_heads, a.head_dim), self.cache_dtype)
            a.bind_kv_cache(cache)
            self.kv_caches.append(cache)
        # keys, then values, of every layer: each region in block order, as fresh blocks are handed out
        self.prefaulter = self.platform.prefault([half for c in self.kv_caches for half in c.unbind(0)])
        if host_slots or disk_dir is not None:
            self.kv_tier = KVTierWorker(self.kv_caches, host_slots, disk_dir, pin_memory=self.platform.name == "cuda")
        if self.use_cuda_graphs:
            self._capture_cuda_graphs()
        if self.use_decode_program and self.cache_dtype != self.dtype:
            self.decode_program_skipped = "the KV cache holds another dtype than the model"
        elif self.use_decode_program:
            self.decode_program, self.decode_program_skipped = build_decode_program(self.model)
            if self.decode_program is not None:
                logger.info("decode steps of up to %d sequences run as one native call", self.decode_program.max_rows)

    # ---- CUDA graphs (CUDA only; everything else runs the model eagerly) ----

    def _capture_cuda_graphs(self) -> None:
        """Capture decode steps of every bucket size over the cache just allocated (with speculative decoding
        also verify steps of 1 + k tokens per sequence, and the draft model's decode passes); on failure log
        it and run eagerly (slower, same results). At --compilation-level 1 and 2 the graphs hold the compiled
        forward (compiled here, at its warm-up run, or loaded): compiled pieces + CUDA graphs."""
        max_blocks = -(-self.max_model_len // self.cache_config.block_size)
        sets = [DecodeGraphs(DEFAULT_BUCKETS, max_blocks, self.device)]
        spec = self.speculative
        if spec is not None:
            sets.append(DecodeGraphs(verify_buckets(spec.disable_by_batch_size), max_blocks, self.device,
                                     query_len=1 + spec.num_speculative_tokens))
        graphs = StepGraphs(sets)
        try:
            with torch.inference_mode():
                graphs.capture(self.forward_fn)
                if self.drafter is not None:
                    self.drafter.capture_graphs(max_blocks)
        except Exception as e:  # noqa: BLE001 - eager mode still works
            self.cuda_graphs, self.cuda_graph_error = None, f"{type(e).__name__}: {e}"
            if self.drafter is not None:
                self.drafter.graphs = None
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", self.cuda_graph_error)
            return
        self.cuda_graphs = graphs

    def _run_model(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states of the flat batch: a CUDA-graph replay for a step staged into one (uniform steps that
        fit), on CPUs the decode program for small decode steps, else the model's forward."""
        if self.pipeline is not None:
            return self.pipeline.run(self.forward_fn, batch.input_ids, batch.positions, batch.meta)
        if self.decode_program is not None and (self.lora is None or self.lora.step.plan is None):
            hidden = self.decode_program.run(batch.input_ids, batch.positions, batch.meta, batch.layout)
            if hidden is not None:
                return hidden
        return hidden_states(self.forward_fn, batch)

    # ---- one step ----

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """Run a hand-made flat batch; float32 logits of each chunk's last token [num_seqs, vocab]
        (or of every token [T, vocab] with `all_logits`)."""
        batch = build_flat_batch(chunks, self.cache_config.block_size, self.device, self.batch.staging,
                                 self.cuda_graphs)
        if self.lora is not None:
            self.lora.clear_step()
        hidden = self._run_model(batch)
        if not all_logits:
            hidden = hidden[batch.logits_indices]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
                ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """One whole step: `execute_model`, then `sample_tokens` with the step's grammar bitmask, asked for
        only once the forward pass has run (the engine fills it meanwhile)."""
        self.execute_model(out)
        data = grammar_bitmask() if grammar_bitmask is not None else None
        mask = None
        if data:
            words = (self.arch.vocab_size + 31) // 32
            mask = to_device(torch.frombuffer(bytearray(data), dtype=torch.int32).view(-1, words), self.device)
        return self.sample_tokens(mask)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Apply the step's batch changes and run the forward pass; returns the float32 logits of the
        requests that sample (one row each, k + 1 for a request with k draft tokens, in batch order),
        or None when none does. `sample_tokens` must follow before the next step."""
        self.batch.update(out, self.eos_token_ids)
        for rid in out.finished_request_ids:
            self._pooling.pop(rid, None)
        for new in out.new_requests:
            if new.pooling_params is not None:
                self._pooling[new.request_id] = new.pooling_params
        if self.lora is not None:
            self._assign_lora_slots(out)
        if self.drafter is not None:
            self.drafter.update(out)
        self._pending = None
        tier = self.kv_tier
        if tier is not None:
            tier.delete(out.kv_deletes)
            tier.start_loads(out.kv_loads)
        self._idle_step = out.is_empty
        if out.is_empty:
            if tier is not None and out.kv_saves:
                tier.save(out.kv_saves)
            return None
        step = self.batch.prepare(out, out.pooling_request_ids, self.cuda_graphs)
        if self.lora is not None:
            self.lora.plan(np.repeat(self.batch.lora_slot[step.rows], np.diff(step.query_start)))
        hidden = self._run_model(step.flat)
        if tier is not None and out.kv_saves:  # the blocks this step computed, before a later step reuses them
            tier.save(out.kv_saves)
        if hidden is None:  # a pipeline stage before the last: it sent its hidden states on
            return None
        # in the matmul's dtype: the sampler widens them to float32 only when it does more than an argmax
        logits = self.model.compute_logits(hidden[step.flat.logits_indices], float32=False) \
            if step.sample.any() else None
        self._pending = (step, hidden, logits)
        return logits

    def _assign_lora_slots(self, out: SchedulerOutput) -> None:
        """Each new request's adapter slot (its adapter loaded into one if it is not resident)."""
        assert self.lora is not None
        batch = self.batch
        for new in out.new_requests:
            if new.lora is not None:
                in_use = {int(s) for s in batch.lora_slot[list(batch.row_of.values())] if s >= 0}
                batch.lora_slot[batch.row_of[new.request_id]] = self.lora.slot_for(new.lora, in_use)

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: torch.Tensor | None = None) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the logits of the last `execute_model` and append the tokens to the batch (with async outputs:
        hand them to the batch on the device, and return before they reach the host).

        `grammar_bitmask` (int32 [sampling rows, ceil(vocab / 32)], bit j of word w allows token 32w + j)
        masks each row's disallowed tokens before sampling."""
        self._settle()
        result = ModelRunnerOutput()
        if self.kv_tier is not None:  # an idle step waits a little for a load rather than spin
            result.kv_loaded, result.kv_dropped, result.kv_disk_error = \
                self.kv_tier.report(wait_s=0.05 if self._idle_step else 0.0)
        if self._pending is None:
            return result
        step, hidden, logits = self._pending
        self._pending = None
        deferred = None
        if logits is not None:
            if grammar_bitmask is not None:
                logits = apply_token_bitmask(logits.float(), grammar_bitmask)
            deferred = self._sample(step, logits, result)
        if step.pool.any():
            self._pool(step, hidden, result)
        if self.drafter is not None:
            chunks = {rid: int(step.starts[i] + step.query_start[i + 1] - step.query_start[i])
                      for i, rid in enumerate(step.req_ids) if not step.sample[i]}
            result.draft_token_ids = self.drafter.propose(self.batch, list(result.sampled_token_ids),
                                                          self.eos_token_ids, chunks)
        lp_rows = self.batch.sampling.prompt_logprobs[step.rows]
        for i in np.flatnonzero((lp_rows >= 0) & (step.starts < self.batch.num_prompt[step.rows])).tolist():
            q0, q1 = int(step.query_start[i]), int(step.query_start[i + 1])
            self._prompt_logprobs(step.req_ids[i], int(step.rows[i]), hidden[q0:q1], int(step.starts[i]), result)
        return result if deferred is None else AsyncModelRunnerOutput(result, deferred)

    def _settle(self) -> None:
        """The batch takes the tokens of the last step with async outputs, once they are on the host."""
        if self._unsettled is not None:
            rows, sample = self._unsettled
            self._unsettled = None
            self.batch.settle(rows, sample.token_ids())

    def _pool(self, step: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Each embedding request's vector (float32 bytes): its hidden states pooled, cut to the dimensions
        it asked for, normalized unless it or the model says not to."""
        assert self.pooler is not None, "embedding requests reach only an engine started with task='embed'"
        idx = np.flatnonzero(step.pool)
        qsl = to_device(step.query_start, hidden.device)
        at = to_device(idx, hidden.device)
        vectors = pool(hidden, qsl[at], qsl[at + 1], self.pooler.pooling_type).cpu()
        for j, i in enumerate(idx.tolist()):
            rid = step.req_ids[i]
            params = self._pooling.pop(rid)
            normalize = self.pooler.normalize if params.normalize is None else params.normalize
            result.pooled[rid] = finish_embedding(vectors[j], params.dimensions, normalize).numpy().tobytes()

    def append_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Take tokens sampled elsewhere (by the last pipeline stage) into this runner's batch."""
        self._settle()
        for rid, toks in sampled.items():
            row = np.array([self.batch.row_of[rid]])
            for tok in toks:
                self.batch.append_tokens(row, np.array([tok]))

    def _sample(self, step: StepInputs, logits: torch.Tensor, result: ModelRunnerOutput) -> AsyncSample | None:
        """One token per sampling request; a request with k draft tokens has k + 1 logits rows, each
        sampled with its own params, and keeps the drafts up to the first that differs from the token
        sampled at its position, plus that token (exact for drafts that are plain token guesses: a
        draft x is kept with probability p(x), and otherwise the sample is a draw from p without x).
        With async outputs (no drafts) the tokens stay on the device: returns their copies to the host."""
        batch = self.batch
        idx = np.flatnonzero(step.sample)
        counts = step.num_logits[idx]
        rows = np.repeat(step.rows[idx], counts)
        offsets = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)  # j within a request
        positions = batch.num_tokens[rows] + offsets  # where each sampled token lands
        meta = batch.sampling.metadata(rows, positions - batch.num_prompt[rows], positions)
        if step.drafts and meta.output_token_counts is not None:
            self._count_drafts(step, idx, counts, rows, meta.output_token_counts)
        sampled = self.sampler(logits, meta)
        req_ids = [step.req_ids[i] for i in idx.tolist()]
        if self.async_outputs and not step.drafts:
            deferred = AsyncSample(req_ids, sampled, batch.sampling.logprobs[rows])  # (first: it may fail)
            batch.sampling.record(rows, sampled.sampled_token_ids)
            batch.defer_tokens(rows, sampled.sampled_token_ids)
            self._unsettled = (rows, deferred)
            return deferred
        ids_np = sampled.sampled_token_ids.cpu().numpy()
        lp = sampled.logprobs
        if not step.drafts:
            batch.append_tokens(rows, ids_np)
            batch.sampling.record(rows, sampled.sampled_token_ids)
            keep = [(j, j + 1) for j in range(len(rows))]
        else:
            keep, start = [], 0
            for i, n in zip(idx.tolist(), counts.tolist()):
                got, draft = ids_np[start:start + n], step.drafts.get(i, [])
                a = next((j for j, d in enumerate(draft) if got[j] != d), len(draft))
                keep.append((start, start + a + 1))
                start += n
            take = np.concatenate([np.arange(a, b) for a, b in keep])
            for j in take.tolist():  # in order: a request's accepted tokens follow each other
                batch.append_tokens(rows[j:j + 1], ids_np[j:j + 1])
            batch.sampling.record(rows[take], sampled.sampled_token_ids[torch.from_numpy(take)])
        ids = ids_np.tolist()
        for rid, (a, b) in zip(req_ids, keep):
            result.sampled_token_ids[rid] = ids[a:b]
        if lp is None:
            return None
        for rid, (a, b) in zip(req_ids, keep):
            k = int(batch.sampling.logprobs[rows[a]])
            if k >= 0:
                result.logprobs[rid] = [TokenLogprobs(
                    ids[j], float(lp.sampled_logprobs[j]), int(lp.sampled_ranks[j]),
                    lp.topk_token_ids[j, :k].tolist(), lp.topk_logprobs[j, :k].tolist()) for j in range(a, b)]
        return None

    @staticmethod
    def _count_drafts(step: StepInputs, idx: np.ndarray, counts: np.ndarray, rows: np.ndarray,
                      output_counts: torch.Tensor) -> None:
        """Row j of a request with drafts samples after drafts[:j]: its penalties count them as outputs."""
        start = 0
        for i, n in zip(idx.tolist(), counts.tolist()):
            for j, d in enumerate(step.drafts.get(i, [])[: n - 1]):
                output_counts[start + j + 1:start + n, d] += 1.0
            start += n

    def _prompt_logprobs(self, req_id: str, row: int, hidden: torch.Tensor, start: int,
                         result: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens start+1 .. from the logits at positions start .. of this chunk
        (position 0, which nothing predicts, gets None)."""
        batch = self.batch
        end = min(start + hidden.shape[0], int(batch.num_prompt[row]) - 1)
        entries: list[TokenLogprobs | None] = [None] if start == 0 else []
        if end > start:
            logprobs = self.model.compute_logits(hidden[: end - start]).log_softmax(-1)
            target_ids = batch.token_ids[row, start + 1:end + 1].copy()
            k = int(batch.sampling.prompt_logprobs[row])
            g = gather_logprobs(logprobs, to_device(target_ids, self.device), max(k, 1))
            lps, ranks, top_ids, top_lps = (x.cpu() for x in (g.sampled_logprobs, g.sampled_ranks, g.topk_token_ids,
                                                              g.topk_logprobs))  # a copy each, not one per token
            for j, tok in enumerate(target_ids.tolist()):
                entries.append(TokenLogprobs(tok, float(lps[j]), int(ranks[j]), top_ids[j, :k].tolist(),
                                             top_lps[j, :k].tolist()))
        result.prompt_logprobs[req_id] = (0 if start == 0 else start + 1, entries)
