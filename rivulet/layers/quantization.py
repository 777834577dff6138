"""Weight formats applied to a loaded model: weight-only quantization (CPU) and prepacked weights.

Every linear layer (but MoE routers) and the LM head get a compact copy of their weight, read by the VNNI kernels
of `rivulet.kernels.cpu` (activations are quantized to int8 in blocks on the fly):

- `int8`: one scale per 64 weights of a row (llama.cpp's Q8_0 layout, `quantize_int8_weight`);
- `int4`: `d * q + m` per 32 weights (llama.cpp's Q4_1, `quantize_int4_weight`), which holds the
  weights of a Q4_1 GGUF file (the default model) exactly. The LM head stays at 8 bits (`int8`):
  llama.cpp's quantization mixes keep the output matrix at 6-8 bits, and the default model's file
  stores it (its tied token embedding) as Q8_0. Requantizing it to 4 bits cost most of the int4
  path's disagreement with the float32 reference (top-1 0.894 -> see docs/cpu.md).

Steps with at most `small_step_rows()` rows (decode of batches up to 32, verify steps, short chunks) read the
compact copy: a fraction of the bytes of a bf16 weight, which is what a memory-bound matrix-vector product
costs, and with 16-row panels the int8/int4 kernels stay ahead of the bf16 matmul up to ~48 rows here.
Bigger steps (prefill chunks, large batches) are compute-bound, where the bf16/AMX matmul on the original
weight is faster, so the original is kept too (the compact copy adds 30-50% to a bf16 model).

`prepack_model` then gives every dense linear (and the big-step side of a quantized one) its weight
in the kernel backend's own layout when the backend has one (`pack_linear_weight`: on CPU oneDNN's
blocked layout for bf16, instead of a repack inside every call). The packed copy replaces the plain
weight, unless another module shares it (a tied LM head's embedding).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rivulet.config import RivuletError
from rivulet.kernels.ops import get_op
from rivulet.layers.embedding import ParallelLMHead
from rivulet.layers.moe import FusedMoE
from rivulet.layers.linear import LinearBase

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]  # (x, weight, bias) -> y

QUANTIZATIONS = ("int8", "int4")
MAX_ROWS = 32  # below the crossover with the bf16 matmul on packed panels (~48 rows: docs/cpu.md), 2 threads
MAX_ROWS_AMX = 8  # the crossover measured against AMX tiles (with the row-major int8/int4 kernels before)


def small_step_rows() -> int:
    """The most rows of a step that reads the compact copies on this CPU."""
    from rivulet.kernels.cpu import ops

    return MAX_ROWS_AMX if ops.AMX_BF16 else MAX_ROWS


class WeightOnly:
    """y = x W^T + b through the compact copy of W for small steps, the original W for big ones."""

    def __init__(self, method: str, weight: torch.Tensor, max_rows: int) -> None:
        self.method, self.max_rows = method, max_rows
        w = weight.detach()
        self.out_features = w.shape[0]  # the last panel of 16 rows may hold rows past it
        self.panels: torch.Tensor = get_op(f"quantize_{method}_weight")(w)
        self._linear = get_op(f"{method}_linear")
        self.dense: Linear = F.linear  # big steps; prepack_model may swap in a packed weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= self.max_rows:
            return self._linear(x, self.panels, self.out_features, bias)
        return self.dense(x, weight, bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU-and-mul of a gate/up projection in its matmul: big steps on a packed original, else None."""
        if x.numel() // x.shape[-1] <= self.max_rows or not isinstance(self.dense, Prepacked):
            return None
        return self.dense.silu_mul(x)

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


def quantize_model(model: nn.Module, method: str | None) -> int:
    """Attach `method`'s weight copies to every layer that takes one; returns their total bytes."""
    if method is None:
        return 0
    if method not in QUANTIZATIONS:
        raise RivuletError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATIONS)}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise RivuletError(f"quantization {method!r} is a CPU weight-only path; it does not run on GPUs")
    total, rows = 0, small_step_rows()
    for name, module in model.named_modules():
        if getattr(module, "quantizable", False) and getattr(module, "weight", None) is not None:
            m = "int8" if method == "int4" and isinstance(module, ParallelLMHead) else method
            try:
                module.quant = WeightOnly(m, module.weight, rows)
            except (ValueError, RuntimeError) as e:  # e.g. int4 scales beyond fp16
                raise RivuletError(f"quantization {method!r}: {name}: {str(e).splitlines()[0]}") from None
            # a buffer, so that the platform can place it
            module.register_buffer("quant_panels", module.quant.panels, persistent=False)
            total += module.quant.nbytes
    return total


class Prepacked:
    """y = x W^T + b through W packed once in the kernel backend's layout (the `weight` argument is unused)."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed
        self._linear, self._silu_mul = get_op("packed_linear"), get_op("packed_linear_silu_mul")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._linear(x, self.packed, bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(self(x)) of a gate/up projection, without bias: one kernel where the layout has one."""
        return self._silu_mul(x, self.packed)


def prepack_model(model: nn.Module, opaque: bool = True) -> int:
    """Pack the weight of every dense linear, and every MoE layer's experts, the kernel backend has a layout
    for; returns how many modules were packed. `opaque` False (a model to compile) keeps weights out of
    layouts held in opaque tensors (oneDNN's, for shapes our kernels do not take, e.g. a router of 8
    experts): a compiled graph cannot take them as inputs (no fake tensor has such a layout)."""
    pack = get_op("pack_linear_weight")
    count = sum(m.pack_experts(opaque) for m in model.modules() if isinstance(m, FusedMoE) and m.packed is None)
    users = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False) if not p.is_mkldnn)
    for module in model.modules():
        if not isinstance(module, (LinearBase, ParallelLMHead)) or not getattr(module, "packable", True) or \
                isinstance(module.quant, Prepacked) or (
                isinstance(module.quant, WeightOnly) and isinstance(module.quant.dense, Prepacked)):
            continue  # packed already
        packed = pack(module.weight)
        if packed is None or (packed.is_mkldnn and not opaque):
            continue
        if isinstance(module.quant, WeightOnly):
            module.quant.dense = Prepacked(packed)
        else:
            module.quant = Prepacked(packed)
        if users[module.weight.data_ptr()] == 1:  # nobody else reads the plain copy: drop it
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.packed_params = ("weight",)  # the platform leaves it where the kernel put it
        count += 1
    return count
