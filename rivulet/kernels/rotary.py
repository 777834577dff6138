"""Rotary position embedding (RoPE): the cos/sin table and its application.

Two layouts of the rotated pairs exist: "neox" pairs dimension i with i + d/2 (Hugging Face's
`rotate_half`), "interleaved" pairs 2i with 2i + 1 (GPT-J, llama.cpp). Only the first
`rotary_dim` dimensions of each head rotate.
"""

from __future__ import annotations

import torch


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, scale: float = 1.0) -> torch.Tensor:
    """[max_position, rotary_dim] float32 table: cos in the first half, sin in the second."""
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    xr, xp = x[..., :rot], x[..., rot:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out, xp], dim=-1) if xp.numel() else out


def apply_rotary_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by the angles of `positions` [T]."""
    cs = cos_sin_cache[positions].to(q.dtype)
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)
