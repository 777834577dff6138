"""Flat batches over scattered KV pages, for the attention kernel tests."""

from __future__ import annotations

import torch

from rivulet.kernels.attention import AttentionMetadata
from rivulet.worker.batch import SeqChunk, build_flat_batch


def scattered_batch(spec: list[tuple[int, int]], block_size: int, seed: int = 0,
                    spare: int = 3) -> tuple[AttentionMetadata, int]:
    """(metadata, number of blocks) of a flat batch of (cached, new) token chunks whose pages are a random
    permutation of the cache's blocks (plus `spare` unused ones), so that stray reads show."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in spec) + spare
    perm = torch.randperm(num_blocks, generator=g).tolist()
    chunks = []
    for cached, new in spec:
        nb = -(-(cached + new) // block_size)
        chunks.append(SeqChunk([0] * new, cached, perm[:nb]))
        perm = perm[nb:]
    return build_flat_batch(chunks, block_size, torch.device("cpu")).meta, num_blocks
