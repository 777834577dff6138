from __future__ import annotations

import torch
from torch import nn

from rivulet.kernels.ops import get_op


class SiluAndMul(nn.Module):
    """SiLU(gate) * up over the fused gate/up projection output."""

    def __init__(self) -> None:
        super().__init__()
        self._silu_and_mul = get_op("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x)
