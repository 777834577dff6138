"""Op registry: an op's name -> its implementation for a kernel backend.

Every op has a "torch" implementation (the plain PyTorch reference, which runs anywhere); faster
backends register beside it. A backend's implementations are named by "module:function" strings
and imported on first use, so importing Rivulet never requires Triton. Layers ask for their ops
once, at construction, through `get_op(name)`, which picks the current platform's backend
(`Platform.kernel_backend()`) and falls back to the reference for ops that backend lacks. Backends of
other packages register theirs from a `rivulet.kernels` plugin (`rivulet/plugins.py`).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F

from rivulet.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from rivulet.kernels.attention import rotary_write_kv_cache_ref, write_kv_cache
from rivulet.kernels.bitmask import apply_token_bitmask_ref
from rivulet.kernels.kv_copy import copy_blocks_ref
from rivulet.kernels.lora import add_lora_ref
from rivulet.kernels.moe import fused_moe, fused_moe_ref, topk_routing_ref
from rivulet.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from rivulet.kernels.quant import (dequantize_gguf_blocks_ref, fp8_linear_ref, int4_linear_ref, int8_linear_ref,
                                   quantize_int4_weight, quantize_int8_weight)
from rivulet.kernels.rotary import apply_rotary_ref
from rivulet.kernels.sampling import argmax_rows_ref, sample_rows_ref, top_k_top_p_ref
from rivulet.plugins import load_kernel_plugins

OpImpl = Callable[..., object]


def pack_linear_weight_ref(weight: torch.Tensor) -> None:
    """The reference backend has no packed layout: linears read the plain weight."""
    return None

def packed_linear_silu_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate/up projection: silu(x W_gate^T) * (x W_up^T), W = [W_gate; W_up]."""
    return silu_and_mul_ref(F.linear(x, weight))


_TRITON = "rivulet.kernels.triton"
_CPU = "rivulet.kernels.cpu.ops"

# op name -> backend -> implementation (a callable, or "module:function" imported lazily)
_OPS: dict[str, dict[str, OpImpl | str]] = {
    "rms_norm": {"torch": rms_norm_ref, "triton": f"{_TRITON}.norm:rms_norm", "cpu": f"{_CPU}:rms_norm"},
    "fused_add_rms_norm": {"torch": fused_add_rms_norm_ref, "triton": f"{_TRITON}.norm:fused_add_rms_norm",
                           "cpu": f"{_CPU}:fused_add_rms_norm"},
    "silu_and_mul": {"torch": silu_and_mul_ref, "triton": f"{_TRITON}.activation:silu_and_mul",
                     "cpu": f"{_CPU}:silu_and_mul"},
    "gelu_tanh_and_mul": {"torch": gelu_tanh_and_mul_ref, "triton": f"{_TRITON}.activation:gelu_tanh_and_mul"},
    "apply_rotary": {"torch": apply_rotary_ref, "triton": f"{_TRITON}.rotary:apply_rotary",
                     "cpu": f"{_CPU}:apply_rotary"},
    "write_kv_cache": {"torch": write_kv_cache, "triton": f"{_TRITON}.kv_cache:write_kv_cache",
                       "cpu": f"{_CPU}:write_kv_cache"},
    # apply_rotary + write_kv_cache in one op: what the RoPE + KV-write fusion pass (rivulet/compilation/) calls
    "rotary_write_kv_cache": {"torch": rotary_write_kv_cache_ref, "cpu": f"{_CPU}:rotary_write_kv_cache",
                              "triton": f"{_TRITON}.rotary:rotary_write_kv_cache"},
    "topk_routing": {"torch": topk_routing_ref, "triton": f"{_TRITON}.moe:topk_routing"},
    "fused_moe": {"torch": fused_moe, "triton": f"{_TRITON}.moe:fused_moe"},
    "packed_fused_moe": {"torch": fused_moe_ref, "cpu": f"{_CPU}:packed_fused_moe"},
    "fp8_linear": {"torch": fp8_linear_ref, "triton": f"{_TRITON}.fp8_linear:fp8_linear"},
    "int8_linear": {"torch": int8_linear_ref, "cpu": f"{_CPU}:int8_linear"},
    "int4_linear": {"torch": int4_linear_ref, "cpu": f"{_CPU}:int4_linear"},
    "quantize_int4_weight": {"torch": quantize_int4_weight, "cpu": f"{_CPU}:quantize_int4_weight"},
    "quantize_int8_weight": {"torch": quantize_int8_weight},
    "dequantize_gguf_blocks": {"torch": dequantize_gguf_blocks_ref, "cpu": f"{_CPU}:dequantize_gguf_blocks"},
    # a backend's own weight layout for dense linears (None: keep the plain [N, K] weight)
    "pack_linear_weight": {"torch": pack_linear_weight_ref, "cpu": f"{_CPU}:pack_linear_weight"},
    "packed_linear": {"torch": F.linear, "cpu": f"{_CPU}:packed_linear"},
    # silu_and_mul(packed_linear(x, w)) of a fused gate/up weight, one kernel where the layout has one
    "packed_linear_silu_mul": {"torch": packed_linear_silu_mul_ref,
                               "cpu": f"{_CPU}:packed_linear_silu_mul"},
    "add_lora": {"torch": add_lora_ref, "cpu": f"{_CPU}:add_lora",
                 "triton": f"{_TRITON}.lora:add_lora"},
    "copy_blocks": {"torch": copy_blocks_ref, "cpu": f"{_CPU}:copy_blocks", "triton": f"{_TRITON}.kv_copy:copy_blocks"},
    "argmax_rows": {"torch": argmax_rows_ref, "cpu": f"{_CPU}:argmax_rows"},
    # a random draw per row (a Gumbel race over noise hashed from the row's key; argmax at temperature 0)
    "sample_rows": {"torch": sample_rows_ref, "cpu": f"{_CPU}:sample_rows", "triton": f"{_TRITON}.sampling:sample_rows"},
    # top-k / top-p masks (-inf); the result may reuse the logits' storage
    "top_k_top_p": {"torch": top_k_top_p_ref, "cpu": f"{_CPU}:top_k_top_p"},
    "apply_token_bitmask": {"torch": apply_token_bitmask_ref, "triton": f"{_TRITON}.bitmask:apply_token_bitmask",
                            "cpu": f"{_CPU}:apply_token_bitmask"},
}



def register_op(name: str, backend: str, impl: OpImpl | str) -> None:
    """Add (or replace) `backend`'s implementation of op `name`."""
    _OPS.setdefault(name, {})[backend] = impl


def op_names() -> list[str]:
    return sorted(_OPS)


def _resolve(impl: OpImpl | str) -> OpImpl:
    if not isinstance(impl, str):
        return impl
    module, _, fn = impl.partition(":")
    return getattr(importlib.import_module(module), fn)


def get_op(name: str, backend: str | None = None) -> OpImpl:
    """`backend`'s implementation of `name` (default: the current platform's kernel backend),
    or the reference when that backend has none."""
    load_kernel_plugins()  # out-of-tree backends register their implementations first (once)
    if name not in _OPS:
        raise ValueError(f"unknown op {name!r}; known: {op_names()}")
    if backend is None:
        from rivulet.platforms import current_platform

        backend = current_platform().kernel_backend()
    impls = _OPS[name]
    if backend not in impls:
        backend = "torch"
    impl = impls[backend] = _resolve(impls[backend])  # imported once
    return impl
