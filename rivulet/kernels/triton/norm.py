"""RMSNorm and residual-add + RMSNorm: one program per row, the whole row in one tile."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from rivulet.kernels.triton.library import graph_op


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # the sum is rounded to the activation dtype first, as the reference's `x + residual` is
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view [rows, cols] with unit stride along cols (copying only when it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            n, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


def _normed_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@graph_op("rms_norm", lambda x, weight, eps: _normed_like(x, weight))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same as `rms_norm_ref`: x * rsqrt(mean(x^2) + eps) * weight over the last dimension."""
    return _launch(x, None, weight, eps)[0]


@graph_op("fused_add_rms_norm", lambda x, residual, weight, eps: (_normed_like(x, weight), x.new_empty(x.shape)))
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as `fused_add_rms_norm_ref`: (rms_norm(x + residual), x + residual), in one pass."""
    out, res = _launch(x, residual, weight, eps)
    assert res is not None
    return out, res
