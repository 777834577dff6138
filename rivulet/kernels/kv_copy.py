"""Batched copies of whole KV blocks between caches of one block shape (the KV tier: a layer's device cache
and its host buffer, each [halves, blocks, block_size, heads, head_size]). The reference gathers and
scatters with tensor indexing (across devices too); the CPU backend copies every (layer, half, block)
with one memcpy each, spread over the threads, with no intermediate tensor."""

from __future__ import annotations

import torch


def copy_blocks_ref(src: list[torch.Tensor], dst: list[torch.Tensor], src_blocks: torch.Tensor,
                    dst_blocks: torch.Tensor) -> None:
    """dst[l][:, dst_blocks[i]] = src[l][:, src_blocks[i]] for every layer l and pair i."""
    if len(src_blocks) == 0:
        return
    for s, d in zip(src, dst, strict=True):
        d[:, dst_blocks.to(d.device)] = s[:, src_blocks.to(s.device)].to(d.device)
