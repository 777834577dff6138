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
from rivulet.kernels.rotary import apply_rotary_ref, rope_cos_sin_cache

__all__ = [
    "AttentionMetadata",
    "apply_rotary_ref",
    "fused_add_rms_norm_ref",
    "fused_moe_ref",
    "get_attention_backend",
    "paged_attention_ref",
    "rms_norm_ref",
    "rope_cos_sin_cache",
    "silu_and_mul_ref",
    "topk_routing_ref",
    "write_kv_cache_ref",
]
