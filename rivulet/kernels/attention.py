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


@dataclass
class _DecodePlan:
    """What every layer's CPU attention needs about the step's decode tokens, built once per step."""

    rows: torch.Tensor  # [S] flat-batch row of each decode token
    seqs: torch.Tensor  # [S] the sequence (index into block_tables / seq_lens) of each decode token
    block_ids: torch.Tensor  # [S * n] the pages of each decode sequence, padded to n pages
    mask: torch.Tensor  # [S, 1, 1, n * block_size] which keys each decode token may see
    prefill: list[int]  # sequences with more than one query token

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> _DecodePlan:
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        n = -(-max((lens[i] for i in decode), default=0) // block_size)
        seq_lens = torch.tensor([lens[i] for i in decode])[:, None]
        k_pos = torch.arange(n * block_size)[None, :]
        mask = k_pos < seq_lens
        if sliding_window is not None:
            mask &= k_pos > seq_lens - 1 - sliding_window
        tables = meta.block_tables[torch.tensor(decode, dtype=torch.long), :n].long().flatten()
        prefill = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] > 1]
        return cls(torch.tensor([qsl[i] for i in decode]), torch.tensor(decode, dtype=torch.long), tables,
                   mask[:, None, None, :], prefill)


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The CPU backend: all decode tokens of the step in one call (the C++ kernel reading the pages
    in place, or without it one SDPA over the gathered pages padded to the longest); prefill chunks
    one sequence at a time through SDPA."""
    _, num_blocks, block_size, hk, d = kv_cache.shape
    key = ("cpu_decode", sliding_window)
    plan = meta.backend_cache.get(key)
    if plan is None:
        plan = meta.backend_cache[key] = _DecodePlan.build(meta, block_size, sliding_window)
    out = torch.empty_like(query)
    s = len(plan.rows)
    ext = _cpu_ext()
    if s and ext is not None and query.dtype == kv_cache.dtype and query.dtype in (torch.float32, torch.bfloat16):
        ext.decode_attention(query, kv_cache, meta.block_tables, meta.seq_lens, plan.rows, plan.seqs, out, scale,
                             sliding_window or 0)
    elif s:
        pages = kv_cache.view(2, num_blocks, -1)
        k = torch.index_select(pages[0], 0, plan.block_ids).view(s, -1, hk, d).transpose(1, 2)
        v = torch.index_select(pages[1], 0, plan.block_ids).view(s, -1, hk, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(query[plan.rows][:, :, None, :], k.to(query.dtype), v.to(query.dtype),
                                           attn_mask=plan.mask, scale=scale, enable_gqa=True)
        out[plan.rows] = o[:, :, 0, :]
    qsl = meta.query_start_loc_cpu
    for i in plan.prefill:
        out[qsl[i]:qsl[i + 1]] = _sequence_attention(query, kv_cache, meta, i, scale, sliding_window)
    return out


def _cpu_ext() -> Any:
    from rivulet.kernels.cpu import load_cpu_ext

    return load_cpu_ext()


AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"], torch.Tensor]

ATTENTION_BACKENDS: dict[str, AttentionFn] = {"torch": paged_attention_ref, "cpu": paged_attention_cpu}

# backends imported on first use, so that importing Rivulet never requires Triton
_LAZY_BACKENDS: dict[str, tuple[str, str]] = {"triton": ("rivulet.kernels.triton.attention", "paged_attention")}


def get_attention_backend(name: str) -> AttentionFn:
    if name not in ATTENTION_BACKENDS and name in _LAZY_BACKENDS:
        module, fn = _LAZY_BACKENDS[name]
        ATTENTION_BACKENDS[name] = getattr(importlib.import_module(module), fn)
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        known = sorted(set(ATTENTION_BACKENDS) | set(_LAZY_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: {known}") from None
