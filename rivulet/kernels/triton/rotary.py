"""Rotary position embedding of q and k, neox or interleaved pairs, partial rotary supported.

One program per token rotates all of its query heads and key heads; dimensions past
``rotary_dim`` are copied unchanged. Out of place, like the reference. `rotary_write_kv_cache` is
the same rotation with the keys stored into their KV-cache slots (and the values beside them) instead
of a tensor: the op of the RoPE + KV-write fusion pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from rivulet.kernels.triton.library import graph_op


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, n_heads, cos, sin,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    ok = (h < n_heads) & (i < HALF)
    x_row = x_ptr + t * stride_xt + h * stride_xh
    o_row = o_ptr + t * stride_ot + h * stride_oh
    if INTERLEAVED:
        i1 = 2 * i
        i2 = 2 * i + 1
    else:
        i1 = i
        i2 = i + HALF
    x1 = tl.load(x_row + i1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2, mask=ok, other=0.0).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    tl.store(o_row + i1, (x1 * cos - x2 * sin).to(dtype), mask=ok)
    tl.store(o_row + i2, (x2 * cos + x1 * sin).to(dtype), mask=ok)
    if HEAD_DIM > 2 * HALF:  # partial rotary: the rest passes through
        j = 2 * HALF + tl.arange(0, PASS_PAD)[None, :]
        ok_pass = (h < n_heads) & (j < HEAD_DIM)
        tl.store(o_row + j, tl.load(x_row + j, mask=ok_pass, other=0.0), mask=ok_pass)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, t, stride_cache, dtype: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token t's cos and sin [1, HALF_PAD]: the table is float32; the reference first casts it to the
    activation dtype."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i < HALF, other=0.0).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    n_q_heads, n_k_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_cache, qo_ptr.dtype.element_ty, HALF, HALF_PAD)
    _rotate_heads(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, n_q_heads, cos, sin,
                  HEAD_DIM, HALF, HQ_PAD, HALF_PAD, PASS_PAD, INTERLEAVED)
    _rotate_heads(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, n_k_heads, cos, sin,
                  HEAD_DIM, HALF, HK_PAD, HALF_PAD, PASS_PAD, INTERLEAVED)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@graph_op("apply_rotary", lambda positions, q, k, cos_sin_cache, interleaved=False: (q.new_empty(q.shape),
                                                                                  k.new_empty(k.shape)))
def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as `apply_rotary_ref`: rotate q [T, Hq, D] and k [T, Hk, D] by `positions` [T]."""
    q, k = _unit_last(q), _unit_last(k)
    t, hq, d = q.shape
    hk = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    cache = _unit_last(cos_sin_cache)
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t:
        _rotary_kernel[(t,)](
            positions, q, k, qo, ko, cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
            cache.stride(0), hq, hk,
            HEAD_DIM=d, HALF=rot // 2, HQ_PAD=triton.next_power_of_2(hq), HK_PAD=triton.next_power_of_2(hk),
            HALF_PAD=triton.next_power_of_2(rot // 2), PASS_PAD=triton.next_power_of_2(max(d - rot, 1)),
            INTERLEAVED=interleaved)
    return qo, ko


@triton.jit
def _rotary_write_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, qo_ptr, cache_ptr, kv_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_vt, stride_cache, value_offset,
    n_q_heads, n_k_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, WIDTH_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_cache, qo_ptr.dtype.element_ty, HALF, HALF_PAD)
    _rotate_heads(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, n_q_heads, cos, sin,
                  HEAD_DIM, HALF, HQ_PAD, HALF_PAD, PASS_PAD, INTERLEAVED)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # the rotated keys go straight into the slot's key row, the values into its value row
        width = n_k_heads * HEAD_DIM
        row = kv_ptr + slot * width
        _rotate_heads(k_ptr, row, t, stride_kt, stride_kh, 0, HEAD_DIM, n_k_heads, cos, sin,
                      HEAD_DIM, HALF, HK_PAD, HALF_PAD, PASS_PAD, INTERLEAVED)
        cols = tl.arange(0, WIDTH_PAD)
        ok = cols < width
        v = tl.load(v_ptr + t * stride_vt + cols, mask=ok)
        tl.store(row + value_offset + cols, v.to(kv_ptr.dtype.element_ty), mask=ok)


@graph_op("rotary_write_kv_cache", lambda positions, q, k, value, cos_sin_cache, interleaved, kv_cache, slot_mapping:
          q.new_empty(q.shape), mutates_args=("kv_cache",))
def rotary_write_kv_cache(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, value: torch.Tensor, cos_sin_cache: torch.Tensor,
    interleaved: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Same as `rotary_write_kv_cache_ref` (plus: slots < 0 are skipped): one program per token rotates its
    query heads, and its key heads into their cache row, beside its values."""
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    q, k = _unit_last(q), _unit_last(k)
    v = value.reshape(value.shape[0], -1)
    v = v if v.stride(-1) == 1 else v.contiguous()
    t, hq, d = q.shape
    hk = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    cache = _unit_last(cos_sin_cache)
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t:
        _rotary_write_kv_kernel[(t,)](
            positions, q, k, v, qo, cache, kv_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), v.stride(0),
            cache.stride(0), kv_cache[0].numel(), hq, hk,
            HEAD_DIM=d, HALF=rot // 2, HQ_PAD=triton.next_power_of_2(hq), HK_PAD=triton.next_power_of_2(hk),
            HALF_PAD=triton.next_power_of_2(rot // 2), PASS_PAD=triton.next_power_of_2(max(d - rot, 1)),
            WIDTH_PAD=triton.next_power_of_2(hk * d), INTERLEAVED=interleaved)
    return qo
