"""Attention over a paged KV cache, for one flat batch that mixes prefill chunks and decodes.

KV cache layout of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys then
values). A token's slot is ``block_id * block_size + offset``. Sequence ``i`` owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` of the batch; its context (cached tokens plus the new
ones) has ``seq_lens[i]`` tokens whose blocks are ``block_tables[i]``. The new tokens are the last
ones of the context, so query token ``j`` of sequence ``i`` sits at position
``seq_lens[i] - q_len + j`` and attends causally up to and including itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
    _, _, block_size, hk, d = kv_cache.shape
    out = torch.empty_like(query)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i, seq_len in enumerate(lens):
        q0, q1 = qsl[i], qsl[i + 1]
        q_len = q1 - q0
        n_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[i, :n_blocks]
        k = kv_cache[0, blocks].reshape(-1, hk, d)[:seq_len]
        v = kv_cache[1, blocks].reshape(-1, hk, d)[:seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        o = F.scaled_dot_product_attention(
            query[q0:q1].transpose(0, 1),
            k.transpose(0, 1).to(query.dtype),
            v.transpose(0, 1).to(query.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"], torch.Tensor]

ATTENTION_BACKENDS: dict[str, AttentionFn] = {"torch": paged_attention_ref}


def get_attention_backend(name: str) -> AttentionFn:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}") from None
