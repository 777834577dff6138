"""Attention over a paged KV cache, for one flat batch that mixes prefill chunks and decodes.

KV cache layout of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys then
values). A token's slot is ``block_id * block_size + offset``. Sequence ``i`` owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` of the batch; its context (cached tokens plus the new
ones) has ``seq_lens[i]`` tokens whose blocks are ``block_tables[i]``. The new tokens are the last
ones of the context, so query token ``j`` of sequence ``i`` sits at position
``seq_lens[i] - q_len + j`` and attends causally up to and including itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step description of the flat batch, shared by every attention layer.

    Device tensors are what GPU kernels read; the ``*_cpu`` lists let CPU code loop over
    sequences without device synchronisation.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # values a backend derives from the fields above once per step and reuses in every layer
    backend_cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def write_kv_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [T, Hk, D] into their slots of the paged cache."""
    _, num_blocks, block_size, hk, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hk, d)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the cached context of each sequence (GQA aware)."""
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    for i in range(meta.num_seqs):
        out[qsl[i]:qsl[i + 1]] = _sequence_attention(query, kv_cache, meta, i, scale, sliding_window)
    return out


def _sequence_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, i: int, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention of sequence i's query tokens over its gathered context."""
    _, _, block_size, hk, d = kv_cache.shape
    q0, q1, seq_len = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1], meta.seq_lens_cpu[i]
    q_len = q1 - q0
    blocks = meta.block_tables[i, : -(-seq_len // block_size)]
    k = kv_cache[0, blocks].reshape(-1, hk, d)[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, hk, d)[:seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    o = F.scaled_dot_product_attention(
        query[q0:q1].transpose(0, 1), k.transpose(0, 1).to(query.dtype), v.transpose(0, 1).to(query.dtype),
        attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"], torch.Tensor]

ATTENTION_BACKENDS: dict[str, AttentionFn] = {"torch": paged_attention_ref}

# backends imported on first use, so that importing Rivulet never requires Triton or a C++ build
_LAZY_BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("rivulet.kernels.cpu.attention", "paged_attention_cpu"),
    "triton": ("rivulet.kernels.triton.attention", "paged_attention"),
}


def get_attention_backend(name: str) -> AttentionFn:
    if name not in ATTENTION_BACKENDS and name in _LAZY_BACKENDS:
        module, fn = _LAZY_BACKENDS[name]
        ATTENTION_BACKENDS[name] = getattr(importlib.import_module(module), fn)
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        known = sorted(set(ATTENTION_BACKENDS) | set(_LAZY_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: {known}") from None
