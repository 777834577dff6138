"""Rotary embedding with the rope scalings Hugging Face configs describe."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rivulet.kernels import rope_cos_sin_cache
from rivulet.kernels.ops import get_op


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (long wavelengths slowed by `factor`)."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        interleaved: bool = False,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        self._apply_rotary = get_op("apply_rotary")
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]  # type: ignore[index]
        elif kind != "default":
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(inv_freq, max_position), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._apply_rotary(positions, q, k, self.cos_sin_cache, self.interleaved)
