"""The CPU kernel backend: the compiled ops of `rivulet.kernels.cpu` behind the reference
signatures, or the references themselves when the extension could not be built; and bf16 linears
on weights packed once (`pack_linear_weight`) for our AMX or AVX512-BF16 kernels, or oneDNN."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rivulet.kernels.activation import silu_and_mul_ref
from rivulet.kernels.attention import rotary_write_kv_cache_ref, write_kv_cache as write_kv_cache_ref_op
from rivulet.kernels.bitmask import apply_token_bitmask_ref
from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.kv_copy import copy_blocks_ref
from rivulet.kernels.library import graph_op
from rivulet.kernels.lora import LoRAPlan, add_lora_batched
from rivulet.kernels.moe import fused_moe_ref
from rivulet.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from rivulet.kernels.quant import (dequantize_gguf_blocks_ref, int4_linear_ref, int8_linear_ref,
                                   quantize_int4_weight as quantize_int4_weight_ref)
from rivulet.kernels.rotary import apply_rotary_ref
from rivulet.kernels.sampling import sample_rows_ref, top_k_top_p_ref

_ext = load_cpu_ext()
AVAILABLE = _ext is not None


def _lib(name: str):
    """The kernel as a dispatcher op (`torch.ops.rivulet.<name>`, registered by the C++ build): one call
    in eager mode and one node torch.compile records without tracing into it."""
    return getattr(torch.ops.rivulet, name).default


if AVAILABLE:
    rms_norm = _lib("rms_norm")
    fused_add_rms_norm = _lib("fused_add_rms_norm")
    silu_and_mul = _lib("silu_and_mul")
    apply_rotary = _lib("apply_rotary")
    write_kv_cache = _lib("write_kv_cache")
    rotary_write_kv_cache = _lib("rotary_write_kv_cache")
    _int8_linear, _int4_linear = _lib("int8_linear"), _lib("int4_linear")

    # fake implementations: output shapes and dtypes for torch.compile's tracing, no arithmetic
    @torch.library.register_fake("rivulet::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake("rivulet::fused_add_rms_norm")
    def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("rivulet::silu_and_mul")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.register_fake("rivulet::apply_rotary")
    def _(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("rivulet::write_kv_cache")
    def _(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("rivulet::rotary_write_kv_cache")
    def _(positions, q, k, value, cos_sin_cache, interleaved: bool, kv_cache, slot_mapping) -> torch.Tensor:
        return q.new_empty(q.shape)

    @torch.library.register_fake("rivulet::decode_attention")
    def _(query, kv_cache, block_tables, seq_lens, rows, seqs, out, scale: float, sliding_window: int) -> None:
        return None

    if hasattr(_ext, "prefill_attention"):
        @torch.library.register_fake("rivulet::prefill_attention")
        def _(query, kv_cache, block_tables, query_start_loc, seq_lens, seqs, out, scale: float, window: int) -> None:
            return None

    def _linear_fake(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("rivulet::int8_linear")
    def _(x, w, n: int, bias=None):
        return _linear_fake(x, n)

    @torch.library.register_fake("rivulet::int4_linear")
    def _(x, w, n: int, bias=None):
        return _linear_fake(x, n)

    if hasattr(_ext, "bf16_linear"):
        @torch.library.register_fake("rivulet::bf16_linear")
        def _(x, packed, bias=None):
            return _linear_fake(x, packed.shape[0] * 16)

    if hasattr(_ext, "amx_linear"):
        @torch.library.register_fake("rivulet::amx_linear")
        def _(x, packed, bias=None):
            return _linear_fake(x, packed.shape[0] * 16)

        @torch.library.register_fake("rivulet::amx_linear_silu_mul")
        def _(x, packed):
            return _linear_fake(x, packed.shape[0] * 8)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    return _int8_linear(x.reshape(-1, k), weight, n, bias).reshape(*x.shape[:-1], -1)


def quantize_int4_weight(weight: torch.Tensor) -> torch.Tensor:
    return _ext.quantize_int4(weight.detach())


def int4_linear(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    return _int4_linear(x.reshape(-1, k), weight, n, bias).reshape(*x.shape[:-1], -1)


_GGUF_KINDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}


def dequantize_gguf_blocks(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype not in (torch.float32, torch.bfloat16):
        return _ext.dequantize_gguf_blocks(blocks.contiguous(), _GGUF_KINDS[kind], torch.float32).to(dtype)
    return _ext.dequantize_gguf_blocks(blocks.contiguous(), _GGUF_KINDS[kind], dtype)


# bf16 linears on weights packed once. F.linear on a plain [N, K] weight has oneDNN repack it at every
# call, which costs a decode step ~1.2x and a 64-row step ~1.4x of the matmul time here (docs/cpu.md).
# oneDNN's packed matmul then spends ~35 us per call around the arithmetic, so the weight goes into our
# own layout where a kernel of ours fits the machine: AMX tiles (`amx_linear.cpp`, 1.5-1.8x of a 1-16
# row step's linears) where AMX-BF16 is usable, else 16-column panels (`bf16_linear.cpp`): `vdpbf16ps`
# on AVX512-BF16 (AMD Zen 4: 2.2x at 1 row, 1.45x at 16) or fp32 FMAs on AVX2-only CPUs, where oneDNN
# has no bf16 matmul and PyTorch's is emulated (Zen 3: 1.7x at 1 row, 4.9x at 64); oneDNN's blocked
# layout elsewhere (AVX-512 without BF16).
PACKED_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
AMX_BF16 = AVAILABLE and _ext.amx_linear_available()
PANEL_BF16 = AVAILABLE and not AMX_BF16 and _ext.bf16_linear_available()
PANEL_ISA = _ext.BF16_LINEAR_ISA if PANEL_BF16 else ""  # "avx512_bf16" or "avx2"


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` is in a layout `pack_linear_weight` made (not a plain [N, K] weight)."""
    return weight.is_mkldnn or weight.dim() in (3, 4)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in this machine's packed layout for `packed_linear`: AMX tiles [N/16, K/32, 16, 32]
    (N % 16 == K % 32 == 0), panels [N/16, K/2, 32] (N % 16 == K % 2 == 0), else oneDNN's; None where
    nothing would pay (not bf16, or no packed kernel for this shape on this CPU)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if AMX_BF16 and n % 16 == 0 and k % 32 == 0:
        return _ext.amx_pack_weight(weight.detach())
    if PANEL_BF16 and n % 16 == 0 and k % 2 == 0:
        return _ext.bf16_pack_weight(weight.detach())
    if PACKED_BF16:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed.dim() == 4:
        return torch.ops.rivulet.amx_linear.default(x, packed, bias)
    if packed.dim() == 3:
        return torch.ops.rivulet.bf16_linear.default(x, packed, bias)
    if not packed.is_mkldnn:
        return F.linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(packed_linear(x, packed)) for a fused gate/up weight: on AMX tiles one kernel, whose blocks
    pair gate block j with up block j and write SiLU(gate) * up (bit for bit the two ops), so the [M, 2I]
    projection is never written and read back (~8% of a prefill step of the default model)."""
    if packed.dim() == 4:
        return torch.ops.rivulet.amx_linear_silu_mul.default(x, packed)
    return silu_and_mul(packed_linear(x, packed))


@graph_op("rivulet_cpu", "packed_fused_moe", lambda x, w13, w2, topk_weights, topk_ids: x.new_empty(x.shape))
def packed_fused_moe(x: torch.Tensor, w13: list[torch.Tensor], w2: list[torch.Tensor], topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe_ref` over experts packed one by one (`pack_linear_weight`), as one op in a compiled graph."""
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, linear=packed_linear, act=silu_and_mul)


if not AVAILABLE:  # same names, reference arithmetic
    rms_norm, fused_add_rms_norm = rms_norm_ref, fused_add_rms_norm_ref  # noqa: F811
    apply_rotary, write_kv_cache, int8_linear = apply_rotary_ref, write_kv_cache_ref_op, int8_linear_ref  # noqa: F811
    rotary_write_kv_cache = rotary_write_kv_cache_ref  # noqa: F811
    int4_linear, silu_and_mul = int4_linear_ref, silu_and_mul_ref  # noqa: F811
    quantize_int4_weight, dequantize_gguf_blocks = quantize_int4_weight_ref, dequantize_gguf_blocks_ref  # noqa: F811


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`apply_token_bitmask_ref`, in C++ for contiguous float32 logits."""
    if _ext is None or logits.dtype != torch.float32 or not logits.is_contiguous() or logits.dim() != 2:
        return apply_token_bitmask_ref(logits, bitmask)
    _ext.apply_token_bitmask(logits, bitmask.to(torch.int32))
    return logits


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of [rows, vocab] float32 or bf16 logits, in C++ (vectorized; rows over the threads)."""
    if _ext is None or logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2 \
            or logits.stride(-1) != 1 \
            or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    return _ext.argmax_rows(logits)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`sample_rows_ref` in C++ (rows over the threads; blocks of tokens that cannot win are not hashed)."""
    if _ext is None or logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2 \
            or logits.stride(-1) != 1 or logits.shape[1] == 0:
        return sample_rows_ref(logits, temperature, keys)
    return _ext.sample_rows(logits, temperature, keys)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """`top_k_top_p_ref` in C++, masking `logits` in place (float32 rows; a radix select per row, no sort)."""
    if _ext is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1 \
            or logits.device.type != "cpu":
        return top_k_top_p_ref(logits, top_k, top_p)
    none = torch.empty(0)
    _ext.top_k_top_p_(logits, none if top_k is None else top_k, none if top_p is None else top_p)
    return logits


def copy_blocks(src: list[torch.Tensor], dst: list[torch.Tensor], src_blocks: torch.Tensor,
                dst_blocks: torch.Tensor) -> None:
    """`copy_blocks_ref`, in C++ when every tensor is on the CPU with contiguous blocks."""
    if _ext is None or not all(t.device.type == "cpu" for t in (*src, *dst)):
        return copy_blocks_ref(src, dst, src_blocks, dst_blocks)
    _ext.copy_blocks(src, dst, src_blocks.cpu(), dst_blocks.cpu())


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: LoRAPlan,
             rows: int, layout: tuple[list[int], list[int]] = ([], [])) -> torch.Tensor:
    """`add_lora_ref` in one C++ call for every adapter of a small step (decodes: it reads each weight once
    per token group, so big steps take the batched PyTorch version, whose GEMMs reuse them)."""
    if AVAILABLE and x.shape[0] <= 64 and y.dim() == 2 and y.is_contiguous() and x.dtype == y.dtype == a.dtype \
            and y.dtype in (torch.float32, torch.bfloat16):
        _ext.add_lora(y, x.contiguous(), a, b, plan.token_slots, rows, *layout)
        return y
    return add_lora_batched(y, x, a, b, plan, rows)
