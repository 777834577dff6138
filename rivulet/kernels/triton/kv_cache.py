"""Store the step's keys and values into their slots of the paged KV cache.

Cache layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is row
``s`` of the flattened ``[num_blocks * block_size, num_kv_heads * head_dim]`` keys (values follow).
A negative slot means "do not store" (padding rows of a CUDA-graph batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from rivulet.kernels.triton.library import graph_op


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, stride_k, stride_v, value_offset, width, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        dst = cache_ptr + slot * width + cols
        k = tl.load(k_ptr + t * stride_k + cols, mask=ok)
        v = tl.load(v_ptr + t * stride_v + cols, mask=ok)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + value_offset, v.to(cache_ptr.dtype.element_ty), mask=ok)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[T, Hk, D] -> [T, Hk*D] with unit stride inside a token (copying only when it must)."""
    x2 = x.reshape(x.shape[0], -1)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@graph_op("write_kv_cache", lambda key, value, kv_cache, slot_mapping: None, mutates_args=("kv_cache",))
def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same as `write_kv_cache_ref` (plus: slots < 0 are skipped)."""
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    k, v = _flat(key), _flat(value)
    t, width = k.shape
    if t == 0:
        return
    block = min(triton.next_power_of_2(width), 2048)
    value_offset = kv_cache[0].numel()
    _write_kv_kernel[(t, triton.cdiv(width, block))](
        k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), value_offset, width, BLOCK=block)
