"""LoRA slots of a linear layer, and the step plan every adapted layer reads.

`LoRASlots` holds `max_loras` adapters' weights for one (possibly fused) linear: A [slots, S*R, in] and
B^T [slots, S*R, out] for its S fused projections (q, k, v of `qkv_proj`; gate, up of `gate_up_proj`) at
most rank R each, projection i of an adapter of rank r in rows [i*r, (i+1)*r) - B block-diagonal, so a
fused layer adds all its projections' deltas in one pair of GEMMs. Under tensor parallelism each rank
keeps what its slice of the layer needs: a column-parallel layer's full A and its rows of B, a
row-parallel layer's columns of A and the full B (its partial deltas are summed by the layer's
all-reduce, like its partial outputs). The weights are copied in by the layer's own `weight_loader`, so
the split is the one the base weights have.

In a compiled model (`--compilation-level 1/2`) each layer's deltas are one opaque op (`add_lora_`, the slots
found by name): the step's plan changes from step to step and is read when the op runs, so one graph
serves every mix of adapters, and steps without any.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from rivulet.kernels.library import graph_op
from rivulet.kernels.lora import LoRAPlan
from rivulet.kernels.ops import get_op

_SLOTS: weakref.WeakValueDictionary[str, LoRASlots] = weakref.WeakValueDictionary()  # by name, for `add_lora_`
_NAMES = itertools.count()


class LoRAStep:
    """The current step's plan (which adapter slots, which tokens each; None: no adapter in the step).
    Written by the model runner before each forward pass, read by every `LoRASlots`."""

    def __init__(self) -> None:
        self.plan: LoRAPlan | None = None


class LoRASlots:
    def __init__(self, linear: torch.nn.Module, slices: list[str], num_slots: int, max_rank: int,
                 step: LoRAStep, dtype: torch.dtype, device: torch.device) -> None:
        from rivulet.layers.linear import QKVParallelLinear, RowParallelLinear

        self.linear, self.slices, self.step = linear, slices, step
        self.row_parallel = isinstance(linear, RowParallelLinear)
        n = len(slices) * max_rank
        self.a = torch.zeros(num_slots, n, linear.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, n, linear.out_features, dtype=dtype, device=device)  # B transposed
        self.rows = [0] * num_slots  # rank rows each slot's adapter uses here (0: it does not adapt this layer)
        self.ranks = [0] * num_slots  # each slot's adapter rank (projection i: rows [i r, (i + 1) r); 0: all)
        sizes = getattr(linear, "output_sizes", None)  # a fused layer's projections' widths (this rank's)
        if isinstance(linear, QKVParallelLinear):
            sizes = [linear.q_size, linear.kv_size, linear.kv_size]
        elif sizes is not None:
            sizes = [size // linear.tp_size for size in sizes]
        self.bounds = [0, *itertools.accumulate(sizes)] if sizes and len(slices) > 1 else []
        self._add_lora = get_op("add_lora")
        self.name = f"lora{next(_NAMES)}"
        _SLOTS[self.name] = self

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.rows[slot] = self.ranks[slot] = 0

    def set(self, slot: int, slice_name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Load one projection's A [r, in] and B [out, r] (full checkpoint shapes) into `slot`. `slice_name`
        is one of `slices`, or the fused layer's own name for a fused adapter (Phi-3's qkv_proj)."""
        r = a.shape[0]
        whole = slice_name not in self.slices
        i = 0 if whole else self.slices.index(slice_name)
        a_rows, b_cols = self.a[slot, i * r:(i + 1) * r], self.b[slot, i * r:(i + 1) * r].t()  # [out, r] views
        a, b = a.to(self.a.dtype), b.to(self.b.dtype)
        loader = self.linear.weight_loader
        if self.row_parallel:  # A split by input columns like the weight; B whole
            loader(a_rows, a)
            b_cols.copy_(b)
        else:  # A whole; B split by output rows like the weight (a fused layer's by its shard)
            a_rows.copy_(a)
            shard = None if whole or len(self.slices) == 1 else _shard_id(self.slices, slice_name)
            loader(b_cols, b) if shard is None else loader(b_cols, b, shard)
        self.rows[slot] = max(self.rows[slot], (i + 1) * r)
        self.ranks[slot] = 0 if whole else r  # 0: one projection over every column (Phi-3's qkv_proj)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus the deltas of the step's adapters, added in place (y unchanged when none of them adapts this
        layer)."""
        if torch.compiler.is_compiling():
            add_lora_(y, x, self.name)
            return y
        plan = self.step.plan
        if plan is None:
            return y
        rows = max(self.rows[s] for s in plan.slots)
        if rows == 0:
            return y
        return self._add_lora(y, x.reshape(-1, x.shape[-1]), self.a, self.b, plan, rows, (self.bounds, self.ranks))


@graph_op("rivulet_lora", "add_lora_", lambda y, x, layer: None, mutates_args=("y",))
def add_lora_(y: torch.Tensor, x: torch.Tensor, layer: str) -> None:
    """The LoRA slots named `layer` add the current step's deltas to y: one op in a compiled graph."""
    _SLOTS[layer].apply(x, y)


def _shard_id(slices: list[str], name: str) -> str | int:
    """The fused layer's shard id of projection `name`: "q"/"k"/"v" for qkv, the index for gate/up."""
    i = slices.index(name)
    return "qkv"[i] if slices == ["q_proj", "k_proj", "v_proj"] else i
