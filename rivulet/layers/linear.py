"""Linear layers that know how they are split over tensor-parallel ranks.

Each parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that copies this
rank's slice of a full checkpoint tensor into it, so model code never slices by hand.
With one rank every split is the whole tensor.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rivulet.distributed import (get_parallel_state, tensor_parallel_all_gather, tensor_parallel_all_reduce,
                                 tensor_parallel_reduce_scatter)
from rivulet.layers.lora import LoRASlots


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by the tensor-parallel size {b}")
    return a // b


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    quantizable = True  # layers.quantization may give it a compact weight copy
    packable = True  # ... or its weight in a kernel's packed layout (not for a layer whose weight is read as is)
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = input_size, output_size  # this rank's (a packed weight's shape differs)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.quant: Callable[..., torch.Tensor] | None = None  # set by layers.quantization after loading (compact or packed weight)
        self.lora: LoRASlots | None = None  # adapter weights, when LoRA serving is on (worker/lora.py)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) through the quantized or prepacked weight when there is one, plus the LoRA
        deltas of the step's adapters (before a row-parallel layer's reduction, which sums them too)."""
        y = F.linear(x, self.weight, bias) if self.quant is None else self.quant(x, self.weight, bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank (e.g. a MoE router)."""

    quantizable = False  # a router's small errors flip expert choices; it is tiny anyway


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split by output rows; each rank produces its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False) -> None:
        self.parallel = get_parallel_state()
        self.tp_rank, self.tp_size = self.parallel.tp_rank, self.parallel.tp_size
        self.gather_output = gather_output
        super().__init__(input_size, _divide(output_size, self.tp_size), bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return tensor_parallel_all_gather(y, self.parallel) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one GEMM (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            parts = loaded.split(self.output_sizes, dim=0)
            for i, part in enumerate(parts):
                self.weight_loader(param, part, i)
            return
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of a [gate; up] projection as the matmul's epilogue, where its weight is packed for a
        kernel that has one and nothing comes between (no bias, LoRA delta or gather); None otherwise."""
        fused = getattr(self.quant, "silu_mul", None)
        if fused is None or len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1] or \
                self.bias is not None or self.lora is not None or self.gather_output:
            return None
        return fused(x)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections. Query heads are split over ranks; key/value heads too, or
    replicated when there are more ranks than key/value heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = get_parallel_state().tp_size
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_heads = _divide(num_heads, tp)
        if tp >= num_kv_heads:
            _divide(tp, num_kv_heads)
            self.num_kv_heads, self.kv_replicas = 1, tp // num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = _divide(num_kv_heads, tp), 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor (Phi-3)
            d = self.head_dim
            parts = loaded.split([self.total_num_heads * d, self.total_num_kv_heads * d, self.total_num_kv_heads * d])
            for shard, part in zip("qkv", parts):
                self.weight_loader(param, part, shard)
            return
        q, kv = self.q_size, self.kv_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """y = x W^T with W split by input columns; partial sums are all-reduced across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True) -> None:
        self.parallel = get_parallel_state()
        self.tp_rank, self.tp_size = self.parallel.tp_rank, self.parallel.tp_size
        self.reduce_results = reduce_results
        super().__init__(_divide(input_size, self.tp_size), output_size, bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: whole, added once after the reduction
            default_weight_loader(param, loaded)
            return
        n = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        if self.reduce_results:  # sequence parallel: keep this rank's token shard of the sum
            y = (tensor_parallel_reduce_scatter if self.parallel.sp else tensor_parallel_all_reduce)(y, self.parallel)
        return y + self.bias if self.bias is not None else y
