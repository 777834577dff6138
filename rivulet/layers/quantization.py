"""Weight-only quantization applied to a loaded model (CPU).

Every linear layer (but MoE routers) and the LM head get a compact copy of their weight, read by the VNNI kernels
of `rivulet.kernels.cpu` (activations are quantized to int8 in blocks on the fly):

- `int8`: one scale per 64 weights of a row (llama.cpp's Q8_0 layout, `quantize_int8_weight`);
- `int4`: `d * q + m` per 32 weights (llama.cpp's Q4_1, `quantize_int4_weight`), which holds the
  weights of a Q4_1 GGUF file (the default model) exactly. The LM head stays at 8 bits (`int8`):
  llama.cpp's quantization mixes keep the output matrix at 6-8 bits, and the default model's file
  stores it (its tied token embedding) as Q8_0. Requantizing it to 4 bits cost most of the int4
  path's disagreement with the float32 reference (top-1 0.894 -> see docs/cpu.md).

Steps with at most `max_rows` rows (decode of small batches) read the compact copy: a fraction of
the bytes of a bf16 weight, which is what a memory-bound matrix-vector product costs. Bigger steps
(prefill chunks, large batches) are compute-bound, where the bf16/AMX matmul on the original
weight is faster, so the original is kept too (the compact copy adds 30-50% to a bf16 model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rivulet.config import RivuletError
from rivulet.kernels.ops import get_op
from rivulet.kernels.quant import quantize_int4_weight, quantize_int8_weight
from rivulet.layers.embedding import ParallelLMHead

QUANTIZATIONS = ("int8", "int4")
MAX_ROWS = 8  # the crossover with the bf16 matmul on AVX512-VNNI + AMX, 2 threads


class WeightOnly:
    """y = x W^T + b through the compact copy of W for small steps, the original W for big ones."""

    def __init__(self, method: str, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> None:
        self.method, self.max_rows = method, max_rows
        w = weight.detach()
        self.tensors = quantize_int8_weight(w) if method == "int8" else quantize_int4_weight(w)
        self._linear = get_op(f"{method}_linear")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= self.max_rows:
            return self._linear(x, *self.tensors, bias)
        return F.linear(x, weight, bias)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def quantize_model(model: nn.Module, method: str | None) -> int:
    """Attach `method`'s weight copies to every layer that takes one; returns their total bytes."""
    if method is None:
        return 0
    if method not in QUANTIZATIONS:
        raise RivuletError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATIONS)}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise RivuletError(f"quantization {method!r} is a CPU weight-only path; it does not run on GPUs")
    total = 0
    for module in model.modules():
        if getattr(module, "quantizable", False) and getattr(module, "weight", None) is not None:
            m = "int8" if method == "int4" and isinstance(module, ParallelLMHead) else method
            module.quant = WeightOnly(m, module.weight)
            for i, t in enumerate(module.quant.tensors):  # buffers, so that the platform can place them
                module.register_buffer(f"quant_{i}", t, persistent=False)
            total += module.quant.nbytes
    return total
