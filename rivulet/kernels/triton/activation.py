"""Gated activations over the fused gate/up projection: out = act(x[:, :d]) * x[:, d:], with act SiLU
(SwiGLU) or the tanh approximation of GELU (GeGLU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from rivulet.kernels.triton.library import graph_op


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0)
    if GELU:  # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), with tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * z)
    else:
        act = gate * tl.sigmoid(gate)
    # rounded like the reference: act(gate) in the activation dtype, then the product
    act = act.to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(up.dtype), mask=ok)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(d), 1024)
    if x2.shape[0]:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, x2.stride(0), out.stride(0), d,
                                                                   GELU=gelu, BLOCK=block)
    return out.view(*x.shape[:-1], d)


def _half_like(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@graph_op("silu_and_mul", _half_like)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same as `silu_and_mul_ref`: [..., 2d] -> [..., d]."""
    return _act_and_mul(x, gelu=False)


@graph_op("gelu_tanh_and_mul", _half_like)
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same as `gelu_tanh_and_mul_ref`: [..., 2d] -> [..., d]."""
    return _act_and_mul(x, gelu=True)
