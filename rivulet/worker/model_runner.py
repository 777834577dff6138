"""Loads the model, owns the paged KV cache, and runs one flat batch per step."""

from __future__ import annotations

import logging

import torch

from rivulet.config import CacheConfig, ModelConfig, RivuletError
from rivulet.layers.attention import Attention
from rivulet.models.arch_config import ArchConfig
from rivulet.models.loader import ModelSource, load_model
from rivulet.platforms import current_platform
from rivulet.worker.batch import SeqChunk, build_flat_batch

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
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []

    @property
    def arch_config(self) -> ArchConfig:
        return self.arch

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
                budget = min(budget, 4 << 30)  # leave the rest of host memory to the system
        return max(budget // self.kv_bytes_per_block(), 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        bs = self.cache_config.block_size
        self.kv_caches = []
        for a in self.attn_layers:
            cache = torch.zeros(2, num_blocks, bs, a.num_kv_heads, a.head_dim, dtype=self.dtype, device=self.device)
            a.kv_cache = cache
            self.kv_caches.append(cache)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB", num_blocks, bs, num_blocks * bs,
                    num_blocks * self.kv_bytes_per_block() / 2**20)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """Run one flat batch; float32 logits of each chunk's last token [num_seqs, vocab]
        (or of every token [T, vocab] with `all_logits`)."""
        batch = build_flat_batch(chunks, self.cache_config.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        if not all_logits:
            hidden = hidden[batch.logits_indices]
        return self.model.compute_logits(hidden)
