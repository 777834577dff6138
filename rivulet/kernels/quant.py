"""fp8 (e4m3) weight quantization: the reference GEMM and the quantizer that produces its inputs.

A weight ``W [N, K]`` is stored as ``W_q = round_fp8(W / scale)`` with either one scale for the
whole tensor (per-tensor, ``scale`` of shape [1]) or one per output row (per-channel, ``scale``
of shape [N]). The activations stay in their own dtype (weight-only quantization): the GEMM
dequantizes the weight and multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_fp8_weight(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], float32 scale [N] or [1]) with ``weight ~= w_q.float() * scale[:, None]``."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    w_q = (w / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_q, scale


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ dequantize(weight [N, K], scale [N] or [1]).T (+ bias), in x's dtype."""
    w = (weight.float() * scale.float().reshape(-1, 1)).to(x.dtype)
    return F.linear(x, w, bias)
