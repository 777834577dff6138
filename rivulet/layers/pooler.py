"""Pooling: one embedding per sequence of the flat batch from its tokens' hidden states."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden [T, H]; whole sequences at rows [starts[i], ends[i]) -> float32 [S, H]: each one's last
    token (LAST), first token (CLS) or the mean over its tokens (MEAN)."""
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type != "MEAN":
        raise ValueError(f"unknown pooling type {pooling_type!r}")
    lens = ends - starts
    seq = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
    tokens = torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens) + torch.arange(
        int(lens.sum()), device=hidden.device)
    sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq, hidden[tokens].float())
    return sums / lens[:, None]


def finish_embedding(vec: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """A pooled vector [H] as the request wants it: its first `dimensions` values, then unit length."""
    if dimensions is not None:
        vec = vec[:dimensions]
    return F.normalize(vec, dim=-1) if normalize else vec
