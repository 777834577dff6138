"""Token bitmasks (structured output): int32 [rows, ceil(vocab / 32)], bit j of word w allows token
32w + j. The reference unpacks the bits with tensor ops; the CPU backend has a C++ kernel."""

from __future__ import annotations

import torch


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place; returns `logits` ([rows, vocab] float)."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    return logits.masked_fill_(~allowed, float("-inf"))
