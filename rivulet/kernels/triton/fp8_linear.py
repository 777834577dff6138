"""fp8 (e4m3) weight-only GEMM: y = x @ (W_fp8 * scale).T (+ bias), x in bf16/fp16/fp32.

The weight tile is loaded as fp8 (half the bytes of bf16: what makes decode faster), converted
to the activation dtype in registers and multiplied; the scale (per tensor, or per output
channel) is applied to the float32 accumulator once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["m"])
def _fp8_linear_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, m, n, k,
    stride_xm, stride_wn, stride_om,
    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = ks + k0 < k
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if PER_CHANNEL:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    else:
        acc = acc * tl.load(scale_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Same as `fp8_linear_ref`: x [..., K], weight fp8 [N, K], scale float32 [N] or [1] -> [..., N]."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a float8_e4m3fn weight, got {weight.dtype}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    scale = scale.float().contiguous()
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 128 if k >= 128 and m <= 16 else 64
    if m:
        _fp8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x2, weight, scale, bias if bias is not None else out, out, m, n, k,
            x2.stride(0), weight.stride(0), out.stride(0),
            PER_CHANNEL=scale.numel() > 1, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4 if block_m <= 16 else 8)
    return out.view(*x.shape[:-1], n)
