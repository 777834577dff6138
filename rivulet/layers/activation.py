from __future__ import annotations

import torch
from torch import nn

from rivulet.kernels import silu_and_mul_ref


class SiluAndMul(nn.Module):
    """SiLU(gate) * up over the fused gate/up projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x)
