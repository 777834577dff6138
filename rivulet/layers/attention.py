"""Attention over the paged KV cache. The cache tensor is bound to the layer once by the model
runner when it allocates the cache; the per-step metadata is passed in every call."""

from __future__ import annotations

import torch
from torch import nn

from rivulet.kernels import AttentionMetadata, get_attention_backend
from rivulet.kernels.ops import get_op
from rivulet.platforms import current_platform


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.sliding_window, self.softcap = scale, sliding_window, softcap or 0.0
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.backend = get_attention_backend(current_platform().attention_backend())
        self._write_kv_cache = get_op("write_kv_cache")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq*D], k and v [T, Hk*D] -> [T, Hq*D]."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: the model runner allocates it before the first step")
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        self._write_kv_cache(k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim),
                           self.kv_cache, meta.slot_mapping)
        return self.backend(q, self.kv_cache, meta, self.scale, self.sliding_window, self.softcap).reshape(t, -1)
