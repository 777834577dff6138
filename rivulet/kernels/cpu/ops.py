"""The CPU kernel backend: the compiled ops of `rivulet.kernels.cpu` behind the reference
signatures, or the references themselves when the extension could not be built; and bf16 linears
through oneDNN on weights packed once (`pack_linear_weight`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rivulet.kernels.activation import silu_and_mul_ref
from rivulet.kernels.attention import write_kv_cache_ref
from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from rivulet.kernels.quant import (dequantize_gguf_blocks_ref, int4_linear_ref, int8_linear_ref,
                                   quantize_int4_weight as quantize_int4_weight_ref)
from rivulet.kernels.rotary import apply_rotary_ref

_ext = load_cpu_ext()
AVAILABLE = _ext is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ext.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, res = _ext.fused_add_rms_norm(x, residual, weight, eps)
    return out, res


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _ext.silu_and_mul(x)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = _ext.apply_rotary(positions, q, k, cos_sin_cache, interleaved)
    return qo, ko


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _ext.write_kv_cache(key, value, kv_cache, slot_mapping)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    k = x.shape[-1]
    return _ext.int8_linear(x.reshape(-1, k), weight, scale, bias).reshape(*x.shape[:-1], -1)


def quantize_int4_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed, d, m = _ext.quantize_int4(weight.detach())
    return packed, d, m


def int4_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    k = x.shape[-1]
    return _ext.int4_linear(x.reshape(-1, k), weight, scale, minv, bias).reshape(*x.shape[:-1], -1)


_GGUF_KINDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}


def dequantize_gguf_blocks(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype not in (torch.float32, torch.bfloat16):
        return _ext.dequantize_gguf_blocks(blocks.contiguous(), _GGUF_KINDS[kind], torch.float32).to(dtype)
    return _ext.dequantize_gguf_blocks(blocks.contiguous(), _GGUF_KINDS[kind], dtype)


# bf16 linears on weights packed once. F.linear on a plain [N, K] weight has oneDNN repack it at every
# call, which costs a decode step ~1.2x and a 64-row step ~1.4x of the matmul time here (docs/cpu.md).
# Where AMX-BF16 is usable the weight goes into our own tile layout (`amx_linear.cpp`: oneDNN's packed
# matmul spends ~35 us per call around the arithmetic, 1.5-1.8x of a 1-16 row step's linears); else into
# oneDNN's blocked layout (AVX512-BF16 machines), whose results are bitwise F.linear's at decode sizes.
PACKED_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
AMX_BF16 = AVAILABLE and _ext.amx_linear_available()


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` is in a layout `pack_linear_weight` made (not a plain [N, K] weight)."""
    return weight.is_mkldnn or weight.dim() == 4


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in this machine's packed layout for `packed_linear` (AMX tiles [N/16, K/32, 16, 32]
    when N % 16 == K % 32 == 0, else oneDNN's), or None where it would not pay (not bf16)."""
    if not PACKED_BF16 or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if AMX_BF16 and n % 16 == 0 and k % 32 == 0:
        return _ext.amx_pack_weight(weight.detach())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed.dim() == 4:
        return _ext.amx_linear(x, packed, bias)
    if not packed.is_mkldnn:
        return F.linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


if not AVAILABLE:  # same names, reference arithmetic
    rms_norm, fused_add_rms_norm = rms_norm_ref, fused_add_rms_norm_ref  # noqa: F811
    apply_rotary, write_kv_cache, int8_linear = apply_rotary_ref, write_kv_cache_ref, int8_linear_ref  # noqa: F811
    int4_linear, silu_and_mul = int4_linear_ref, silu_and_mul_ref  # noqa: F811
    quantize_int4_weight, dequantize_gguf_blocks = quantize_int4_weight_ref, dequantize_gguf_blocks_ref  # noqa: F811
