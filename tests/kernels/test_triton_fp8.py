"""Triton fp8 weight-only GEMM vs `fp8_linear_ref` (dequantize, then F.linear)."""

from __future__ import annotations

import pytest
import torch

from triton_helpers import DTYPES, close, randn

from rivulet.kernels.quant import fp8_linear_ref, quantize_fp8_weight
from rivulet.kernels.triton.fp8_linear import fp8_linear


def test_quantize_round_trip():
    w = randn(32, 64, scale=0.05)
    for per_channel in (False, True):
        w_q, scale = quantize_fp8_weight(w, per_channel)
        assert w_q.dtype == torch.float8_e4m3fn and scale.shape == ((32,) if per_channel else (1,))
        deq = w_q.float() * scale.reshape(-1, 1)
        assert (deq - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("m,n,k,bias", [(1, 96, 128, False), (5, 64, 80, True), (33, 130, 256, False)])
def test_fp8_linear(m, n, k, bias, per_channel, dtype):
    x = randn(m, k, dtype=dtype)
    w_q, scale = quantize_fp8_weight(randn(n, k, scale=0.05), per_channel)
    b = randn(n, dtype=dtype) if bias else None
    close(fp8_linear(x, w_q, scale, b), fp8_linear_ref(x, w_q, scale, b), dtype, scale=2)


def test_fp8_linear_batched_input():
    x = randn(2, 3, 64)
    w_q, scale = quantize_fp8_weight(randn(48, 64), True)
    got = fp8_linear(x, w_q, scale)
    assert got.shape == (2, 3, 48)
    close(got, fp8_linear_ref(x, w_q, scale), torch.float32)
