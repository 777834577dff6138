"""Kernel-level ops. Each op has a plain PyTorch reference (`*_ref`); faster versions are
registered beside it and chosen through the platform. Tests compare every fast version against
its reference on random inputs."""

from rivulet.kernels.activation import silu_and_mul_ref
from rivulet.kernels.attention import (
    AttentionMetadata,
    get_attention_backend,
    paged_attention_ref,
    write_kv_cache_ref,
)
from rivulet.kernels.moe import fused_moe_ref, topk_routing_ref
from rivulet.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from rivulet.kernels.ops import get_op
from rivulet.kernels.quant import fp8_linear_ref, quantize_fp8_weight
from rivulet.kernels.rotary import apply_rotary_ref, rope_cos_sin_cache

__all__ = [
    "AttentionMetadata",
    "apply_rotary_ref",
    "fp8_linear_ref",
    "fused_add_rms_norm_ref",
    "fused_moe_ref",
    "get_attention_backend",
    "get_op",
    "paged_attention_ref",
    "quantize_fp8_weight",
    "rms_norm_ref",
    "rope_cos_sin_cache",
    "silu_and_mul_ref",
    "topk_routing_ref",
    "write_kv_cache_ref",
]
