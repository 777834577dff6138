"""Random weights of a config's shape: benchmarks of big models without their files."""

from __future__ import annotations

import torch
from torch import nn


def init_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """Small uniform values (like vLLM's dummy loader) so activations stay finite; norms get 1.

    The values are drawn on each parameter's own device (one seeded generator per device), so a
    GPU model of billions of parameters fills in seconds."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(p.device).manual_seed(seed)
        noise = torch.rand(p.shape, generator=gen, dtype=torch.float32, device=p.device)
        p.data.copy_(noise * (high - low) + low)
