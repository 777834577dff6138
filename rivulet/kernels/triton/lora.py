"""Multi-LoRA deltas of a batch mixing adapters, one program per (token, block of output columns):
y[i, cols] += (A_s[:rows] x[i]) . B_s^T[:rows, cols] for the token's slot s (base tokens: nothing).

The same as `add_lora_ref`. Each program computes its token's rank vector t = A_s x itself (rows <= a
few dozen, so recomputing it per column block is cheaper than a second launch), in float32, then adds
t B^T to its columns, rounded once to y's dtype. Adapter weights come in y's dtype; the planner's
gather/mask are not needed: the per-token slot is read directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rivulet.kernels.lora import LoRAPlan


@triton.jit
def _add_lora_kernel(y_ptr, x_ptr, a_ptr, b_ptr, slots_ptr, rows, d_in, d_out, stride_y, stride_x,
                     stride_as, stride_ar, stride_bs, stride_br,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        r_ok = r < rows
        t = tl.zeros((BLOCK_R,), tl.float32)
        for k0 in range(0, d_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < d_in
            xv = tl.load(x_ptr + i * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                         mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            t += tl.sum(av * xv[None, :], axis=1)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ok = cols < d_out
        bv = tl.load(b_ptr + slot * stride_bs + r[:, None] * stride_br + cols[None, :],
                     mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(bv * t[:, None], axis=0)
        yv = tl.load(y_ptr + i * stride_y + cols, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + i * stride_y + cols, (yv + delta).to(y_ptr.dtype.element_ty), mask=c_ok)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: LoRAPlan, rows: int,
             layout: tuple[list[int], list[int]] = ([], [])) -> torch.Tensor:
    """Same as `add_lora_ref` (in place on y [T, out]; a [S, R, in], b = B^T [S, R, out])."""
    if y.stride(-1) != 1 or x.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("add_lora: the last dimensions must be contiguous")
    t, d_out = y.shape
    if t == 0 or rows == 0:
        return y
    block_n = min(128, triton.next_power_of_2(d_out))
    _add_lora_kernel[(t, triton.cdiv(d_out, block_n))](
        y, x, a, b, plan.token_slots, rows, x.shape[1], d_out, y.stride(0), x.stride(0),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BLOCK_R=max(16, triton.next_power_of_2(rows)), BLOCK_K=64, BLOCK_N=block_n)
    return y
