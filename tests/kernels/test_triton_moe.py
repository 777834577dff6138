"""Triton top-k routing and fused MoE vs `topk_routing_ref` / `fused_moe_ref`."""

from __future__ import annotations

import pytest
import torch

from triton_helpers import DEVICE, DTYPES, close, randn

from rivulet.kernels import fused_moe_ref, topk_routing_ref
from rivulet.kernels.triton.moe import align_by_expert, fused_moe, topk_routing


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("t,e,k", [(9, 8, 2), (5, 6, 2), (3, 60, 4), (4, 8, 1)])
def test_topk_routing(t, e, k, renormalize):
    logits = randn(t, e, scale=2.0)
    w, ids = topk_routing(logits, k, renormalize)
    want_w, want_ids = topk_routing_ref(logits, k, renormalize)
    assert ids.dtype == want_ids.dtype == torch.int64 and w.dtype == want_w.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    close(w, want_w, torch.float32)


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_by_expert(block_m):
    e, k = 7, 2
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(i))[:k] for i in range(11)]).to(DEVICE)
    sorted_ids, block_expert, num_padded = align_by_expert(ids, e, block_m)
    flat = ids.flatten()
    n = flat.numel()
    used = int(num_padded)
    assert sorted(p for p in sorted_ids[:used].tolist() if p < n) == list(range(n))  # every pair once
    assert (sorted_ids[used:] == n).all()
    for b in range(used // block_m):  # each block holds pairs of its expert only
        pairs = [p for p in sorted_ids[b * block_m:(b + 1) * block_m].tolist() if p < n]
        assert pairs and all(int(flat[p]) == int(block_expert[b]) for p in pairs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,inter,e,k", [(1, 64, 48, 8, 2), (13, 96, 80, 6, 2), (40, 64, 64, 4, 3)])
def test_fused_moe(t, h, inter, e, k, dtype):
    x = randn(t, h, dtype=dtype)
    w13, w2 = randn(e, 2 * inter, h, dtype=dtype, scale=0.1), randn(e, h, inter, dtype=dtype, scale=0.1)
    weights, ids = topk_routing_ref(randn(t, e), k, True)
    close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids), dtype, scale=3)
