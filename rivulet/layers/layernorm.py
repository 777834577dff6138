"""RMSNorm that optionally adds the residual first (one fused op in the fast kernels)."""

from __future__ import annotations

import torch
from torch import nn

from rivulet.kernels.ops import get_op


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self._rms_norm, self._fused_add_rms_norm = get_op("rms_norm"), get_op("fused_add_rms_norm")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._fused_add_rms_norm(x, residual, self.weight, self.eps)
