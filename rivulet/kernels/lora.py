"""LoRA for a batch that mixes adapters: y += (x A_s^T) B_s^T for the tokens of each adapter slot s.

Adapter weights live in slots: `a` [slots, rank rows, in] and `b` [slots, rank rows, out] (B transposed,
scaled; unused rank rows zero). A step is planned once (`LoRAPlan`): each token's slot, and the slots present
with their tokens padded to the longest slot's count. The reference loops over the slots (two GEMMs each);
the batched version gathers every slot's tokens into one [slots, tokens, in] tensor and runs two batched
GEMMs for all adapters at once, then adds the deltas back (padding rows masked to zero): five ops per layer
whatever the number of adapters. The CPU kernel (`cpu_ops.cpp: add_lora`, decode-sized steps) and the
Triton kernel (`triton/lora.py`) are one call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAPlan:
    token_slots: torch.Tensor  # [T] int64: each token's slot, -1 for the base model
    slots: list[int]  # the adapter slots present in the step, in order
    slot_ids: torch.Tensor | None  # the same as a tensor, or None when they are 0 .. len - 1 (weights sliced)
    gather: torch.Tensor | None  # [len(slots) * max_tokens] token rows, slot after slot, padded with row 0;
    # None: every token of the step belongs to the one slot present
    mask: torch.Tensor | None  # [len(slots), max_tokens, 1] 1 for a real token, 0 for padding (None: no padding)
    max_tokens: int


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: LoRAPlan,
                 rows: int, layout: tuple[list[int], list[int]] = ([], [])) -> torch.Tensor:
    """y [T, out] plus, for each slot s of the plan, x[tokens of s] A_s[:rows]^T B_s[:rows] (in place).
    `layout` (a fused layer's projection column bounds and each slot's rank, which let a kernel skip the
    zero blocks of B) does not change the result."""
    x = x.to(a.dtype)
    for s in plan.slots:
        idx = torch.nonzero(plan.token_slots == s)[:, 0]
        y.index_add_(0, idx, ((x.index_select(0, idx) @ a[s, :rows].t()) @ b[s, :rows]).to(y.dtype))
    return y


def add_lora_batched(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: LoRAPlan,
                     rows: int, layout: tuple[list[int], list[int]] = ([], [])) -> torch.Tensor:
    """Same as `add_lora_ref`, every slot at once: gather, two batched GEMMs, mask, scatter-add."""
    k = len(plan.slots)
    a = (a[:k] if plan.slot_ids is None else a.index_select(0, plan.slot_ids))[:, :rows]
    b = (b[:k] if plan.slot_ids is None else b.index_select(0, plan.slot_ids))[:, :rows]
    x = x.to(a.dtype)
    if plan.gather is None:  # one adapter for the whole step
        return y.add_(((x @ a[0].t()) @ b[0]).to(y.dtype))
    xs = x.index_select(0, plan.gather).view(k, plan.max_tokens, x.shape[-1])
    t = torch.bmm(xs, a.transpose(1, 2))
    if plan.mask is not None:
        t.mul_(plan.mask)
    return y.index_add_(0, plan.gather, torch.bmm(t, b).view(-1, y.shape[-1]).to(y.dtype))
