"""SiLU-and-mul over the fused gate/up projection: out = silu(x[:, :d]) * x[:, d:]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0)
    # rounded like the reference: silu(gate) in the activation dtype, then the product
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(up.dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same as `silu_and_mul_ref`: [..., 2d] -> [..., d]."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(d), 1024)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, x2.stride(0), out.stride(0), d, BLOCK=block)
    return out.view(*x.shape[:-1], d)
