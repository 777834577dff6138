"""The CPU attention backend over the paged KV cache (layout in `rivulet.kernels.attention`).

Two C++ kernels read the pages in place, each one call per layer for the whole step: decode tokens
(one query token per sequence) and the sequences with more than one query token (prefill chunks,
k-token steps; `prefill_attention.cpp`, flash attention with the query rows in the vector lanes).
Without the C++ build (or bf16 without AVX512-BF16) decodes are one SDPA over the gathered pages
padded to the longest context, and each prefill chunk one SDPA over its gathered context, in the
4-D layout that PyTorch's fused CPU kernel (flash attention) takes (a 3-D call falls back to the
unfused math path, about 15x slower at 1k tokens). A chunk that starts at position 0 needs no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rivulet.kernels.attention import AttentionMetadata
from rivulet.kernels.cpu import load_cpu_ext


@dataclass
class DecodePlan:
    """What every layer's CPU attention needs about the step's decode tokens, built once per step."""

    rows: torch.Tensor  # [S] flat-batch row of each decode token
    seqs: torch.Tensor  # [S] the sequence (index into block_tables / seq_lens) of each decode token
    block_ids: torch.Tensor  # [S * n] the pages of each decode sequence, padded to n pages
    mask: torch.Tensor  # [S, 1, 1, n * block_size] which keys each decode token may see
    prefill: list[int]  # sequences with more than one query token
    prefill_seqs: torch.Tensor  # the same, as a tensor for the kernel

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> DecodePlan:
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
                   mask[:, None, None, :], prefill, torch.tensor(prefill, dtype=torch.long))


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, i: int, scale: float,
                      sliding_window: int | None) -> torch.Tensor:
    """Sequence i's query tokens [q_len, Hq, D] over its gathered context, by the fused SDPA kernel."""
    _, _, block_size, hk, d = kv_cache.shape
    q0, q1, seq_len = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1], meta.seq_lens_cpu[i]
    q_len = q1 - q0
    blocks = meta.block_tables[i, : -(-seq_len // block_size)]
    k = kv_cache[0, blocks].reshape(-1, hk, d)[:seq_len].transpose(0, 1)[None]
    v = kv_cache[1, blocks].reshape(-1, hk, d)[:seq_len].transpose(0, 1)[None]
    q = query[q0:q1].transpose(0, 1)[None]
    mask = None
    if sliding_window is not None or q_len != seq_len:  # causal from a later start, or a window
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the paged cache: decodes in one call, prefill chunks in
    one more (or one SDPA each without the kernel)."""
    _, num_blocks, block_size, hk, d = kv_cache.shape
    key = ("cpu_decode", sliding_window)
    plan = meta.backend_cache.get(key)
    if plan is None:
        plan = meta.backend_cache[key] = DecodePlan.build(meta, block_size, sliding_window)
    out = torch.empty_like(query)
    s = len(plan.rows)
    ext = load_cpu_ext()
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
    if plan.prefill and prefill_kernel(ext, query, kv_cache):
        ext.prefill_attention(query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                              plan.prefill_seqs, out, scale, sliding_window or 0)
        return out
    qsl = meta.query_start_loc_cpu
    for i in plan.prefill:
        out[qsl[i]:qsl[i + 1]] = prefill_attention(query, kv_cache, meta, i, scale, sliding_window)
    return out


def prefill_kernel(ext, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C++ prefill kernel takes this layer: float32, or bf16 where AVX512-BF16 is; head groups
    of at most 32 query heads; query rows with the head dim contiguous."""
    if ext is None or not hasattr(ext, "prefill_attention") or query.dtype != kv_cache.dtype:
        return False
    if not (query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and ext.PREFILL_ATTENTION_BF16)):
        return False
    hq, d, hk = query.shape[1], query.shape[2], kv_cache.shape[3]
    return hq % hk == 0 and hq // hk <= 32 and query.stride(2) == 1 and (query.dtype == torch.float32 or d % 2 == 0)
