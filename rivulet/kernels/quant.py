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


# --- int8 weights and int8 activations in blocks of 64 (the CPU VNNI kernel's arithmetic) ---
INT8_BLOCK = 64


INT_PANEL = 16  # weight rows per panel of the int8 and int4 layouts
INT8_BLOCK_BYTES = 1088  # one block of a panel: 16 groups of 64 bytes, then the 16 rows' scales (float32)


def _panel_rows(v: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """[N, blocks, ...] -> [ceil(N / 16), 16, blocks, ...], rows past N `fill`."""
    n = v.shape[0]
    panels = -(-n // INT_PANEL)
    v = torch.cat([v, v.new_full((panels * INT_PANEL - n, *v.shape[1:]), fill)])
    return v.view(panels, INT_PANEL, *v.shape[1:])


def _scale_bytes(v: torch.Tensor) -> torch.Tensor:
    """[N, blocks] float32 or float16 -> [ceil(N / 16), blocks, 16 * itemsize]: each block's 16 values as bytes."""
    return _panel_rows(v).transpose(1, 2).contiguous().view(torch.uint8)


def _rows_of_scales(packed: torch.Tensor, lo: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float32 [panels * 16, blocks] of the 16 `dtype` values stored from byte lo of each block."""
    panels, nb, _ = packed.shape
    size = 16 * torch.finfo(dtype).bits // 8
    v = packed[..., lo:lo + size].contiguous().view(dtype).float()
    return v.transpose(1, 2).reshape(panels * INT_PANEL, nb)


def quantize_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """[ceil(N / 16), Kp / 64, 1088] uint8: each block of 64 weights of a row as offset-binary bytes
    ``(w_u8 - 128) * scale`` with a symmetric scale (llama.cpp's Q8_0 with 64-blocks; Kp is K rounded up to
    64, padded with 128, zero), in panels of 16 rows: per panel and block, 16 groups of 64 bytes where
    bytes 4i .. 4i + 3 of group g hold row i's elements 4g .. 4g + 3 (one `vpdpbusd` per group covers 16
    rows), then the 16 rows' scales as float32 bytes. Rows past N: weights 128, scale 0."""
    w = weight.float()
    n, k = w.shape
    kp = -(-k // INT8_BLOCK) * INT8_BLOCK
    blocks = F.pad(w, (0, kp - k)).view(n, kp // INT8_BLOCK, INT8_BLOCK)
    scale = (blocks.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    q = (torch.round(blocks / scale[..., None]).clamp(-127, 127) + 128).to(torch.uint8)
    q = _panel_rows(q.view(n, kp // INT8_BLOCK, 16, 4), fill=128)  # panel, row, block, group, byte
    groups = q.permute(0, 2, 3, 1, 4).reshape(q.shape[0], kp // INT8_BLOCK, 1024)
    return torch.cat([groups, _scale_bytes(scale.float())], dim=-1).contiguous()


def dequantize_int8_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """[n, Kp] float32 weights of `quantize_int8_weight`'s output."""
    panels, nb, size = packed.shape
    assert size == INT8_BLOCK_BYTES, f"int8 panels have blocks of {INT8_BLOCK_BYTES} bytes, not {size}"
    q = packed[..., :1024].reshape(panels, nb, 16, INT_PANEL, 4).permute(0, 3, 1, 2, 4)  # panel, row, block, g, b
    q = q.reshape(panels * INT_PANEL, nb, INT8_BLOCK).float() - 128
    return (q * _rows_of_scales(packed, 1024)[..., None]).view(panels * INT_PANEL, nb * INT8_BLOCK)[:n]


def quantize_activation(x: torch.Tensor, kp: int, block: int) -> torch.Tensor:
    """x [M, K] as the CPU kernels see it: rounded to int8 per block (one symmetric scale per
    block) and dequantized back, in float32, zero-padded to kp columns."""
    m, k = x.shape
    xf = F.pad(x.float(), (0, kp - k)).view(m, kp // block, block)
    s = xf.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(s > 0, torch.round(xf / torch.where(s > 0, s, 1)), 0)
    return (q * s).view(m, kp)


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_int8_weight(weight, n).T (+ bias), x quantized like the kernel."""
    k, kp = x.shape[-1], weight.shape[1] * INT8_BLOCK
    xq = quantize_activation(x.reshape(-1, k), kp, INT8_BLOCK)
    y = xq @ dequantize_int8_weight(weight, n).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


# --- 4-bit weights (llama.cpp's Q4_1: d * q + m per block of 32) with int8 activations in blocks of 32 ---
INT4_BLOCK = 32


INT4_BLOCK_BYTES = 320  # one block of a panel: 256 bytes of 4-bit values, then 16 d and 16 m (fp16)


def quantize_int4_weight(weight: torch.Tensor) -> torch.Tensor:
    """[ceil(N / 16), Kp / 32, 320] uint8: `weight` [N, K] as ``d * q + m`` per block of 32 of a row, q in
    0..15 (Q4_1's rule: m = block min, d = (max - min) / 15, both stored as fp16 and q rounded against the
    stored values, so the dequantized values of a Q4_1 tensor come back exactly; Kp is K rounded up to 64,
    zero-padded), in panels of 16 rows. Per panel and block: 4 groups of 64 bytes, where bytes 4i .. 4i + 3 of
    group v hold row i's elements 8v .. 8v + 3 in their low nibbles and 8v + 4 .. 8v + 7 in their high ones
    (one `vpdpbusd` per group and nibble half covers 16 rows), then the 16 rows' d and m as fp16 bytes. Rows
    past N are zero."""
    w = weight.float()
    n, k = w.shape
    kp = -(-k // 64) * 64
    nb = kp // INT4_BLOCK
    blocks = F.pad(w, (0, kp - k)).view(n, nb, INT4_BLOCK)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d16, m16 = ((hi - lo) / 15).half(), lo.half()
    d, m = d16.float(), m16.float()
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError("quantize_int4: weights beyond the fp16 range of the scales")
    q = torch.where(d[..., None] > 0, torch.round((blocks - m[..., None]) / torch.where(d > 0, d, 1)[..., None]), 0)
    q = _panel_rows(q.clamp(0, 15).to(torch.uint8).view(n, nb, 4, 2, 4))  # panel, row, block, group, half, byte
    nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(q.shape[0], nb, 256)
    return torch.cat([nibbles, _scale_bytes(d16), _scale_bytes(m16)], dim=-1).contiguous()


def dequantize_int4_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """[n, Kp] float32 weights of `quantize_int4_weight`'s output."""
    panels, nb, size = packed.shape
    assert size == INT4_BLOCK_BYTES, f"int4 panels have blocks of {INT4_BLOCK_BYTES} bytes, not {size}"
    nibbles = packed[..., :256].reshape(panels, nb, 4, INT_PANEL, 4)  # panel, block, group, row, byte
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=4)  # panel, block, group, row, half, byte
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(panels * INT_PANEL, nb, INT4_BLOCK).float()
    d, m = _rows_of_scales(packed, 256, torch.float16), _rows_of_scales(packed, 288, torch.float16)
    w = q * d[..., None] + m[..., None]
    return w.view(panels * INT_PANEL, nb * INT4_BLOCK)[:n]


def int4_linear_ref(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(weight, n).T (+ bias), x quantized like the kernel (blocks of 32)."""
    k, kp = x.shape[-1], weight.shape[1] * INT4_BLOCK
    xq = quantize_activation(x.reshape(-1, k), kp, INT4_BLOCK)
    y = xq @ dequantize_int4_weight(weight, n).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


# GGUF's 32-weight blocks: kind -> bytes per block (fp16 scale(s), then the quants)
GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def dequantize_gguf_blocks_ref(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF blocks (uint8 [n, bytes per block]) as n * 32 weights: Q8_0 ``q * d``, Q4_0
    ``d * (nibble - 8)``, Q4_1 ``d * nibble + m``, in float32 (the `gguf` package's values, bitwise),
    then rounded to `dtype`. Weights 0-15 of a 4-bit block are the low nibbles, 16-31 the high ones."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if kind == "q8_0":
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).reshape(-1).to(dtype)
    qs = blocks[:, 4:] if kind == "q4_1" else blocks[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    if kind == "q4_0":
        return (d * (q.to(torch.int8) - 8).float()).reshape(-1).to(dtype)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q.float() + m).reshape(-1).to(dtype)
