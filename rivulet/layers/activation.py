from __future__ import annotations

import torch
from torch import nn

from rivulet.kernels.ops import get_op

# a model config's activation name -> the op applying it to a fused gate/up projection
_GATED_OPS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


class ActAndMul(nn.Module):
    """act(gate) * up over the fused gate/up projection output (SwiGLU for silu, GeGLU for gelu)."""

    def __init__(self, act: str = "silu") -> None:
        super().__init__()
        if act not in _GATED_OPS:
            raise ValueError(f"unsupported gated activation {act!r}; supported: {sorted(_GATED_OPS)}")
        self.name = act
        self._op = get_op(_GATED_OPS[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)

