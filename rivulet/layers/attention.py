"""Attention over the paged KV cache. The cache tensor is bound to the layer once by the model
runner when it allocates the cache; the per-step metadata is passed in every call.

`MLAAttention` is multi-head latent attention (DeepSeek-V2/V3) in its absorbed form: the cache holds one
vector per token (the compressed latent and the rotary key), read by every head as both key and value
(the value is the latent part). It runs on the same backends as `Attention`: its cache is bound as
a [2, ...] view whose two halves are the same memory (stride 0), so a backend reading "values"
reads the keys, and the output's first `latent_dim` columns are the latent attention output.

`EncoderAttention` (BERT) caches nothing: each sequence of the step attends to itself, both ways."""

from __future__ import annotations

import torch
from torch import nn

from rivulet.kernels import AttentionMetadata, get_attention_backend
from rivulet.kernels.attention import varlen_attention, write_kv_cache, write_latent_cache
from rivulet.kernels.ops import get_op
from rivulet.platforms import current_platform


class Attention(nn.Module):
    kv_halves = 2  # the cache holds keys and values

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

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """Use `cache` [kv_halves, num_blocks, block_size, num_kv_heads, head_dim] from now on. A cache of another
        dtype than the model's (`--kv-cache-dtype fp8_e5m2`) is written by the reference, which rounds to it."""
        self.kv_cache = cache
        if cache.dtype.itemsize == 1:
            self._write_kv_cache = write_kv_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq*D], k and v [T, Hk*D] -> [T, Hq*D]."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: the model runner allocates it before the first step")
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        self._write_kv_cache(k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim),
                           self.kv_cache, meta.slot_mapping)
        return self.backend(q, self.kv_cache, meta, self.scale, self.sliding_window, self.softcap).reshape(t, -1)


class EncoderAttention(nn.Module):
    """An encoder's attention (BERT): every token sees its whole sequence; no KV cache, so the model
    runner allocates none for it."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq*D], k and v [T, Hk*D] -> [T, Hq*D]."""
        t, d = q.shape[0], self.head_dim
        out = varlen_attention(q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d),
                               v.view(t, self.num_kv_heads, d), meta.query_start_loc, self.scale)
        return out.reshape(t, -1)


class MLAAttention(Attention):
    """Heads over one shared cached vector per token: [latent (latent_dim) | rotary key (rope_dim)]."""

    kv_halves = 1

    def __init__(self, num_heads: int, latent_dim: int, rope_dim: int, scale: float) -> None:
        super().__init__(num_heads, latent_dim + rope_dim, scale, num_kv_heads=1)
        self.latent_dim = latent_dim

    def forward(self, q: torch.Tensor, entry: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # type: ignore[override]
        """q [T, H, latent+rope] (the no-rope part already absorbed into latent space), entry [T, latent+rope]
        (this step's tokens, stored in the cache [1, num_blocks, block_size, 1, latent+rope]) -> [T, H, latent]."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: the model runner allocates it before the first step")
        write_latent_cache(entry, self.kv_cache, meta.slot_mapping)
        # values = keys: the same memory, seen twice (a view made here, so a compiled graph writes the cache
        # itself, not a stride-0 view of it, which it could not write back)
        out = self.backend(q, self.kv_cache.expand(2, -1, -1, -1, -1), meta, self.scale, None, 0.0)
        return out[..., :self.latent_dim]
