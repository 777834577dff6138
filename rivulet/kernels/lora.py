"""LoRA for a batch that mixes adapters: y += (x A_s^T) B_s^T for the tokens of each adapter slot s.

Adapter weights live in slots: `a` [slots, rank rows, in], `b` [slots, out, rank rows] (B already scaled).
A step is planned once as segments, (slot, token indices or None for every token, rank rows used), and
each adapted linear adds its deltas segment by segment: two small GEMMs per adapter present in the step
(a segmented gather-GEMM; tokens of the base model cost nothing).
"""

from __future__ import annotations

import torch

Segment = tuple[int, "torch.Tensor | None", int]  # (slot, token indices or None: all tokens, rank rows)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 segments: list[Segment]) -> torch.Tensor:
    """y [T, out] plus each segment's x[idx] A_s[:rows]^T B_s[:, :rows]^T (in place; returns y)."""
    for slot, idx, rows in segments:
        if rows == 0:
            continue
        xs = x if idx is None else x.index_select(0, idx)
        delta = (xs @ a[slot, :rows].t()) @ b[slot, :, :rows].t()
        if idx is None:
            y += delta
        else:
            y.index_add_(0, idx, delta)
    return y
