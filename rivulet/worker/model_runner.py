"""Loads the model, owns the paged KV cache, and runs one flat batch per step."""

from __future__ import annotations

import logging

import torch

from rivulet.config import CacheConfig, ModelConfig, RivuletError
from rivulet.core.outputs import SchedulerOutput
from rivulet.distributed import get_parallel_state
from rivulet.layers.attention import Attention
from rivulet.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from rivulet.models.loader import ModelSource, load_model
from rivulet.platforms import current_platform
from rivulet.worker.batch import FlatBatch, SeqChunk, build_flat_batch
from rivulet.worker.cuda_graph import DEFAULT_BUCKETS, DecodeGraphs
from rivulet.worker.input_batch import InputBatch, RequestState
from rivulet.worker.outputs import ModelRunnerOutput, TokenLogprobs

logger = logging.getLogger(__name__)

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
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, source: ModelSource) -> None:
        self.platform = current_platform()
        self.device = self.platform.device
        self.dtype = resolve_dtype(model_config.dtype)
        self.cache_config = cache_config
        torch.manual_seed(model_config.seed)
        self.model, self.arch = load_model(model_config, source, self.dtype, self.device)
        self.platform.place_module(self.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.batch = InputBatch(self.device)
        self.eos_token_ids: set[int] = set(self.arch.eos_token_ids)  # the engine may add more
        self.max_model_len = model_config.max_model_len or self.arch.max_position_embeddings
        # graphs need kernels that skip padding slots and never sync (the Triton ones), and one rank
        self.use_cuda_graphs = (self.platform.name == "cuda" and not model_config.enforce_eager
                                and self.platform.kernel_backend() == self.platform.attention_backend() == "triton"
                                and get_parallel_state().world_size == 1)
        self.cuda_graphs: DecodeGraphs | None = None
        self.cuda_graph_error: str | None = None  # why capture failed (the runner then stays eager)

    def set_eos_token_ids(self, ids: set[int]) -> None:
        self.eos_token_ids = set(ids)

    # ---- KV cache ----

    def kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        per_layer = 2 * self.cache_config.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        return per_layer * len(self.attn_layers)

    def num_blocks_for_budget(self) -> int:
        """Blocks that fit the configured KV memory (or a share of the free memory)."""
        cc = self.cache_config
        if cc.num_blocks is not None:
            return cc.num_blocks
        budget = cc.kv_cache_memory
        if budget is None:
            budget = int(self.platform.free_memory_bytes() * cc.memory_utilization)
            if self.platform.name == "cpu":
                budget = min(budget, 2 << 30)  # leave the rest of host memory to the system
        return max(budget // self.kv_bytes_per_block(), 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        bs = self.cache_config.block_size
        self.kv_caches = []
        for a in self.attn_layers:
            cache = self.platform.zeros((2, num_blocks, bs, a.num_kv_heads, a.head_dim), self.dtype)
            a.kv_cache = cache
            self.kv_caches.append(cache)
        if self.use_cuda_graphs:
            self._capture_cuda_graphs()

    # ---- CUDA graphs (CUDA only; everything else runs the model eagerly) ----

    def _capture_cuda_graphs(self) -> None:
        """Capture decode steps of every bucket size over the cache just allocated; on failure
        log it and run eagerly (slower, same results)."""
        max_blocks = -(-self.max_model_len // self.cache_config.block_size)
        graphs = DecodeGraphs(DEFAULT_BUCKETS, max_blocks, self.device)
        try:
            with torch.inference_mode():
                graphs.capture(self.model)
        except Exception as e:  # noqa: BLE001 - eager mode still works
            self.cuda_graphs, self.cuda_graph_error = None, f"{type(e).__name__}: {e}"
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", self.cuda_graph_error)
            return
        self.cuda_graphs = graphs

    def _run_model(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states of the flat batch: a CUDA-graph replay for decode steps that fit one."""
        if self.cuda_graphs is not None:
            hidden = self.cuda_graphs.run(batch.input_ids, batch.positions, batch.meta)
            if hidden is not None:
                return hidden
        return self.model(batch.input_ids, batch.positions, batch.meta)

    # ---- one step ----

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """Run a hand-made flat batch; float32 logits of each chunk's last token [num_seqs, vocab]
        (or of every token [T, vocab] with `all_logits`)."""
        batch = build_flat_batch(chunks, self.cache_config.block_size, self.device)
        hidden = self._run_model(batch)
        if not all_logits:
            hidden = hidden[batch.logits_indices]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens of every request and sample for those that reach the end
        of their known tokens."""
        self.batch.update(out)
        result = ModelRunnerOutput()
        if out.is_empty:
            return result
        states = [self.batch.requests[rid] for rid in out.num_scheduled_tokens]
        chunks, rows, prompt_rows = [], [], []
        offset = 0
        for st, n in zip(states, out.num_scheduled_tokens.values()):
            start = st.num_computed_tokens
            chunks.append(SeqChunk(st.token_ids[start:start + n], start, st.block_ids))
            if start + n >= len(st.token_ids):
                rows.append((st, offset + n - 1))
            if st.params.prompt_logprobs is not None and start < st.num_prompt_tokens:
                prompt_rows.append((st, offset, start, n))
            offset += n
        batch = build_flat_batch(chunks, self.cache_config.block_size, self.device)
        hidden = self._run_model(batch)
        if hidden is None:  # a pipeline stage before the last: it sent its hidden states on
            return result
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor([i for _, i in rows], device=self.device)])
            self._sample([st for st, _ in rows], logits, result)
        for st, off, start, n in prompt_rows:
            self._prompt_logprobs(st, hidden[off:off + n], start, result)
        return result

    def _sample(self, states: list[RequestState], logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        meta = SamplingMetadata.build(
            [st.params for st in states], [st.token_ids[:st.num_prompt_tokens] for st in states],
            [st.output_token_ids for st in states], [self.eos_token_ids] * len(states),
            [self.batch.generators.get(st.req_id) for st in states], logits.shape[-1], self.device)
        sampled = self.sampler(logits, meta)
        ids = sampled.sampled_token_ids.tolist()
        lp = sampled.logprobs
        for row, (st, tok) in enumerate(zip(states, ids)):
            st.token_ids.append(tok)
            result.sampled_token_ids[st.req_id] = [tok]
            if lp is not None and st.params.logprobs is not None:
                k = st.params.logprobs
                result.logprobs[st.req_id] = [TokenLogprobs(
                    tok, float(lp.sampled_logprobs[row]), int(lp.sampled_ranks[row]),
                    lp.topk_token_ids[row, :k].tolist(), lp.topk_logprobs[row, :k].tolist())]

    def _prompt_logprobs(self, st: RequestState, hidden: torch.Tensor, start: int, result: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens start+1 .. from the logits at positions start .. of this chunk
        (position 0, which nothing predicts, gets None)."""
        end = min(start + hidden.shape[0], st.num_prompt_tokens - 1)
        entries: list[TokenLogprobs | None] = [None] if start == 0 else []
        if end > start:
            logprobs = self.model.compute_logits(hidden[: end - start]).log_softmax(-1)
            targets = torch.tensor(st.token_ids[start + 1:end + 1], device=self.device)
            k = st.params.prompt_logprobs or 0
            g = gather_logprobs(logprobs, targets, max(k, 1))
            for j in range(end - start):
                entries.append(TokenLogprobs(int(targets[j]), float(g.sampled_logprobs[j]), int(g.sampled_ranks[j]),
                                             g.topk_token_ids[j, :k].tolist(), g.topk_logprobs[j, :k].tolist()))
        result.prompt_logprobs[st.req_id] = (0 if start == 0 else start + 1, entries)
