"""Attention over the paged KV cache for one flat batch of prefill chunks and decode tokens.

One "unified" kernel (the design of vLLM's Triton unified attention): a program takes a block of
``BLOCK_Q`` query tokens of one sequence and the ``GROUP`` query heads that share one KV head
(GQA), i.e. ``BLOCK_M = BLOCK_Q * GROUP`` rows, and walks the sequence's keys in tiles of
``TILE_N`` tokens through the block table with an online softmax. Causal and sliding-window masks
come from positions: query token ``j`` of a sequence sits at ``seq_len - q_len + j``.

Programs are laid out without any host-side data: sequence ``s`` owns program ids
``qsl[s] // BLOCK_Q + s`` .. (exclusive) ``qsl[s+1] // BLOCK_Q + s + 1``, enough for its
``ceil(q_len / BLOCK_Q)`` query blocks, so the grid is ``T // BLOCK_Q + num_seqs`` and a program
finds its sequence by binary search over ``query_start_loc``. Extra programs return at once.
Nothing depends on host copies of the metadata, so the launch can be captured in a CUDA graph.

Decode-only steps with few sequences would leave the GPU idle (one program per sequence and KV
head), so they split each sequence's keys into ``NUM_SEGMENTS`` segments computed in parallel
and merged by a second small kernel (split-K / flash-decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rivulet.kernels.attention import AttentionMetadata
from rivulet.kernels.triton.library import graph_op

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The last sequence s with qsl[s] // BLOCK_Q + s <= pid."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# the batch size must not pick a compiled variant: each CUDA-graph bucket would compile its own
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seg_acc_ptr, seg_ml_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    num_seqs, scale_log2, softcap, window, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # position of the sequence's first query token

        rows = tl.arange(0, BLOCK_M)
        q_idx = q_block * BLOCK_Q + rows // GROUP  # query token within the sequence
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
        q_pos = context + q_idx
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q_off = (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

        # keys this query block can see: [kv_lo, kv_hi)
        kv_hi = tl.minimum(context + q_block * BLOCK_Q + BLOCK_Q, seq_len)
        kv_lo = 0
        if SLIDING:
            kv_lo = tl.maximum(context + q_block * BLOCK_Q - window + 1, 0)
        tile_lo = kv_lo // TILE_N
        tile_hi = tl.cdiv(kv_hi, TILE_N)
        if NUM_SEGMENTS > 1:
            per_segment = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
            tile_lo = tile_lo + segment * per_segment
            tile_hi = tl.minimum(tile_hi, tile_lo + per_segment)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        for tile in range(tile_lo, tile_hi):
            k_pos = tile * TILE_N + tl.arange(0, TILE_N)
            k_ok = k_pos < kv_hi
            block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // block_size, mask=k_ok, other=0)
            kv_off = block.to(tl.int64) * stride_kb + (k_pos % block_size) * stride_ks + kv_head * stride_kh
            k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None], mask=k_ok[None, :] & dim_ok[:, None], other=0.0)
            s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
            if SOFTCAP:  # cap * tanh(scores / cap), tanh(z) = 2 sigmoid(2z) - 1, in the log2 domain
                s = (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * softcap
            allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            if SLIDING:
                allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new

        token = (q_start + q_idx).to(tl.int64)
        if NUM_SEGMENTS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:  # unnormalised partials [T, Hq, NUM_SEGMENTS, D] and (max, sum) [T, Hq, NUM_SEGMENTS, 2]
            part = (token * (tl.num_programs(1) * GROUP) + head) * NUM_SEGMENTS + segment
            tl.store(seg_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(seg_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(seg_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_segments_kernel(
    seg_acc_ptr, seg_ml_ptr, out_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    part = (t * num_heads + h) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    m = tl.load(seg_ml_ptr + part * 2)
    l = tl.load(seg_ml_ptr + part * 2 + 1)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # 0 for empty segments
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(seg_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :])
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _num_segments(num_tokens: int, num_seqs: int, num_kv_heads: int) -> int:
    """Split the keys only for decode-only steps that give the GPU too few programs otherwise.

    Depends on shapes only, so a CUDA-graph bucket always gets the same answer."""
    if num_tokens != num_seqs:  # not one query token per sequence
        return 1
    return 16 if num_seqs * num_kv_heads < 128 else 1


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float = 0.0,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Same as `paged_attention_ref`: causal attention of query [T, Hq, D] over each sequence's
    cached context (GQA, optional sliding window and score cap) -> [T, Hq, D].

    `num_segments` (a power of 2) overrides the split-K choice for decode-only batches; tests use it."""
    return _attention(query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                      sliding_window or 0, softcap, num_segments or 0)


@graph_op("paged_attention", lambda query, kv_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
          softcap, num_segments: query.new_empty(query.shape))
def _attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, scale: float, sliding_window: int, softcap: float,
               num_segments: int) -> torch.Tensor:
    """`paged_attention` on the metadata's tensors (an op takes no dataclass); a window or a segment
    count of 0: none given."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    t, hq, d = query.shape
    _, _, block_size, hk, _ = kv_cache.shape
    if hq % hk:
        raise ValueError(f"{hq} query heads do not share {hk} KV heads evenly")
    if kv_cache.stride(-1) != 1:
        raise ValueError("the KV cache must have unit stride along head_dim")
    group = hq // hk
    out = query.new_empty(query.shape)
    num_seqs = seq_lens.shape[0]
    if t == 0:
        return out
    decode_only = t == num_seqs  # every sequence has at least one query token
    fp32 = query.dtype == torch.float32
    if decode_only:
        block_m, tile_n, warps = max(16, triton.next_power_of_2(group)), 32, 4
    else:  # 8 warps hold a 64 x 128 float32 accumulator without spilling registers
        block_m, tile_n, warps = max(32 if fp32 else 64, triton.next_power_of_2(group)), 32 if fp32 else 64, 8
    block_q = block_m // group
    segments = num_segments or _num_segments(t, num_seqs, hk)
    if segments > 1 and not decode_only:
        raise ValueError("split-K attention is for decode-only batches")
    d_pad = max(16, triton.next_power_of_2(d))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if segments > 1:
        seg_acc = torch.empty(t * hq * segments, d_pad, dtype=torch.float32, device=query.device)
        seg_ml = torch.empty(t * hq * segments, 2, dtype=torch.float32, device=query.device)
    else:
        seg_acc = seg_ml = out  # unused
    grid = (t // block_q + num_seqs, hk, segments)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, seg_acc, seg_ml,
        block_tables, seq_lens, query_start_loc,
        num_seqs, scale * _LOG2E, softcap * _LOG2E, sliding_window, block_size,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=d, HEAD_DIM_PAD=d_pad, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        SLIDING=sliding_window > 0, SOFTCAP=bool(softcap), NUM_SEGMENTS=segments,
        DOT_PRECISION="ieee" if fp32 else "tf32", num_warps=warps,
    )
    if segments > 1:
        _merge_segments_kernel[(t, hq)](
            seg_acc, seg_ml, out, hq, out.stride(0), out.stride(1),
            HEAD_DIM=d, HEAD_DIM_PAD=d_pad, NUM_SEGMENTS=segments)
    return out

