"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x[..., :d]) * x[..., d:] for the concatenated gate/up projection of width 2d."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
