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


def _longrope_cache(exponents: torch.Tensor, base: float, max_position: int, s: dict[str, Any]) -> torch.Tensor:
    """Phi-3's LongRoPE: per-frequency divisors, `short_factor` for positions below the pretraining
    length and `long_factor` beyond it, cos/sin scaled by sqrt(1 + ln(factor) / ln(original length)).
    Per position, as Hugging Face decodes (it picks one set per forward by the largest position, so a
    prompt longer than the original length prefilled at once gets the long set for all its tokens)."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def table(ext: list[float]) -> torch.Tensor:
        return rope_cos_sin_cache(1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponents), max_position,
                                  attention_factor)

    short, long = table(s["short_factor"]), table(s["long_factor"])
    return torch.cat([short[:original], long[original:]])


def _yarn_inv_freq(exponents: torch.Tensor, base: float, max_position: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek-V2/V3, Qwen long context): frequencies blended from extrapolated (high) to interpolated by
    `factor` (low) across a ramp between the dimensions that turn beta_fast and beta_slow times over the
    original context; cos/sin scaled by the attention factor (from `mscale` / `mscale_all_dim` when given)."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position / original
    dim = exponents.shape[0] * 2

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        attention = mscale(s["mscale"]) / mscale(s["mscale_all_dim"]) if s.get("mscale") and s.get("mscale_all_dim") \
            else mscale()

    def turning_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = turning_dim(s.get("beta_fast") or 32), turning_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1.0 / base**exponents
    return extrapolated / factor * ramp + extrapolated * (1 - ramp), float(attention)


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
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (base**exponents)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind in ("longrope", "su"):
            self.register_buffer("cos_sin_cache", _longrope_cache(exponents, base, max_position, scaling),  # type: ignore[arg-type]
                                 persistent=False)
            return
        if kind == "yarn":
            inv_freq, attention = _yarn_inv_freq(exponents, base, max_position, scaling)  # type: ignore[arg-type]
            self.register_buffer("cos_sin_cache", rope_cos_sin_cache(inv_freq, max_position, attention),
                                 persistent=False)
            return
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]  # type: ignore[index]
        elif kind != "default":
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, longrope, yarn)")
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(inv_freq, max_position), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._apply_rotary(positions, q, k, self.cos_sin_cache, self.interleaved)
