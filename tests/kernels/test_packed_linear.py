"""bf16 linears on oneDNN-packed weights (the CPU backend's `pack_linear_weight` / `packed_linear`):
no C++ extension involved, so these run wherever PyTorch has oneDNN's bf16 matmul."""

from __future__ import annotations

import pytest
import torch

from rivulet.kernels.cpu import ops as cpu_ops


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.skipif(not cpu_ops.PACKED_BF16, reason="this PyTorch build has no oneDNN bf16 matmul")
@pytest.mark.parametrize("rows", [1, 5, 16, 64, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_equals_f_linear(rows: int, bias: bool) -> None:
    w = randn(1152, 576, dtype=torch.bfloat16)
    b = randn(1152, dtype=torch.bfloat16, seed=2) if bias else None
    packed = cpu_ops.pack_linear_weight(w)
    assert packed is not None and packed.is_mkldnn and packed.shape == w.shape
    x = randn(rows, 576, dtype=torch.bfloat16, seed=1)
    # the same oneDNN kernels on a weight packed once: the same bits at decode and small-prefill sizes
    assert torch.equal(cpu_ops.packed_linear(x, packed, b), torch.nn.functional.linear(x, w, b))
    x3 = x.reshape(1, rows, 576)  # leading dims are kept
    assert cpu_ops.packed_linear(x3, packed, b).shape == (1, rows, 1152)


def test_pack_linear_weight_keeps_float32_plain() -> None:
    # float32 matmuls stay on PyTorch's own path (and its numbers): nothing to pack
    assert cpu_ops.pack_linear_weight(randn(8, 16, dtype=torch.float32)) is None
    w = randn(8, 16, dtype=torch.float32)
    x = randn(3, 16, dtype=torch.float32, seed=1)
    assert torch.equal(cpu_ops.packed_linear(x, w), torch.nn.functional.linear(x, w))  # a plain weight works too
