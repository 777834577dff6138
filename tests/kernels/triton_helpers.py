"""Shared by the Triton kernel tests: device, dtypes and tolerances for the machine at hand."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly; on a GPU both dtypes are checked
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
# fp32 on a GPU: tl.dot may use tf32
TOL = {torch.float32: 2e-3 if DEVICE.type == "cuda" else 1e-5, torch.bfloat16: 3e-2}

_gen = torch.Generator().manual_seed(1234)


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Random normal values (never zeros), made on the CPU with a fixed generator, moved to DEVICE."""
    return (torch.randn(*shape, generator=_gen) * scale).to(dtype).to(DEVICE)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    tol = TOL[dtype] * scale
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
