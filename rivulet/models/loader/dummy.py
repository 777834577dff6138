"""Random weights of a config's shape: benchmarks of big models without their files."""

from __future__ import annotations

import torch
from torch import nn


def init_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """Small uniform values (like vLLM's dummy loader) so activations stay finite; norms get 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32) * (high - low) + low)
