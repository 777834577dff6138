"""Mixture-of-experts: top-k routing and the expert computation."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from rivulet.kernels.activation import silu_and_mul_ref
from rivulet.kernels.library import graph_op


def topk_routing_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), keep the top k; optionally rescale them to sum to 1.

    Returns (weights [T, k] float32, expert ids [T, k] int64).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk_routing_ref(
    router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", bias: torch.Tensor | None = None,
    n_group: int = 1, topk_group: int = 1, group_by: str = "max", renormalize: bool = False, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing: scores by softmax (V2) or sigmoid (V3); experts chosen by score + `bias` (V3's
    correction, which never weights an expert), among the `topk_group` of `n_group` groups whose best
    score (`group_by` "max", V2) or top-2 sum ("top2", V3) is highest; weights are the plain scores,
    renormalised to sum to 1 if asked, times `scale`. Returns (weights [T, k] float32, ids [T, k] int64)."""
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1 and topk_group < n_group:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_score = grouped.max(-1).values if group_by == "max" else grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor | Sequence[torch.Tensor],
    w2: torch.Tensor | Sequence[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_ref,
) -> torch.Tensor:
    """sum_k weight_k * expert_{id_k}(x) with expert(x) = w2 @ silu_and_mul(w13 @ x).

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]. Experts with no tokens are
    skipped; per expert, its tokens are gathered, computed as one GEMM and scattered back, in ascending
    expert order. `linear` and `act` may be a backend's: then w13[e] and w2[e] are in `linear`'s weight
    layout (the CPU's packed experts, one per list entry).
    """
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        h = act(linear(x[token_idx], w13[e]))
        y = linear(h, w2[e]) * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y)
    return out


def _moe_like(x: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape)


@graph_op("rivulet_ref", "fused_moe", _moe_like)
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe_ref` on stacked weights, as one op in a compiled graph (its loop over the experts that have
    tokens depends on the data, which Dynamo cannot trace)."""
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
