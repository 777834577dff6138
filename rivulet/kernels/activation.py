"""Gated activations: act(gate) * up over the concatenated gate/up projection of width 2d."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x[..., :d]) * x[..., d:] (SwiGLU)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """GELU(x[..., :d]) in its tanh approximation, times x[..., d:] (GeGLU, Gemma)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
