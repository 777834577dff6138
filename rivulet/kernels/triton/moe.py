"""Mixture of experts: top-k routing and the expert computation as grouped GEMMs.

The expert computation follows vLLM's fused_moe: the T*k (token, expert) pairs are sorted by
expert and each expert's run is padded to a multiple of ``BLOCK_M``; one GEMM kernel then takes a
``BLOCK_M`` block of pairs, all of one expert, times that expert's weight. Two such GEMMs
(gate/up, then down, the latter scaled by the routing weight) around SiLU-and-mul, and a sum over
the k slots of each token.

The sort/pad step (`align_by_expert`) is plain PyTorch on the device without host
synchronisation: its outputs have a size fixed by T, k and E, so it can run in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rivulet.kernels.triton.activation import silu_and_mul
from rivulet.kernels.triton.library import graph_op


# ---- routing ----

@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_l, num_experts,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < num_experts, p, -1.0)  # padding is never chosen
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int64)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # lowest index among ties
        weights = tl.where(slots == i, best, weights)
        ids = tl.where(slots == i, idx.to(tl.int64), ids)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weights_ptr + t * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


@graph_op("topk_routing", lambda router_logits, top_k, renormalize: (
    router_logits.new_empty((router_logits.shape[0], top_k), dtype=torch.float32),
    router_logits.new_empty((router_logits.shape[0], top_k), dtype=torch.int64)))
def topk_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as `topk_routing_ref`: (weights [T, k] float32, expert ids [T, k] int64)."""
    t, e = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _topk_softmax_kernel[(t,)](logits, weights, ids, logits.stride(0), e, TOP_K=top_k,
                                   K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e),
                                   RENORMALIZE=renormalize)
    return weights, ids


# ---- sorting (token, expert) pairs by expert ----

def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*k pairs by expert, each expert's run padded to a multiple of `block_m`.

    Returns (sorted_ids [P]: flat pair index t*k + slot, or T*k for padding; block_expert
    [P // block_m]: the expert of each block; num_padded [1]: used length of sorted_ids), where
    P bounds the padded length from T, k and E alone (no device-to-host copy).
    """
    flat = topk_ids.flatten()
    n = flat.numel()
    device = flat.device
    p = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded  # where each expert's run begins in sorted_ids
    first_of_expert = torch.cumsum(counts, 0) - counts  # rank offset of each expert in the stable sort
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    dest = run_start[sorted_expert] + torch.arange(n, device=device) - first_of_expert[sorted_expert]
    sorted_ids = torch.full((p,), n, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest, order)
    ends = torch.cumsum(padded, 0)
    block_starts = torch.arange(0, p, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert, ends[-1:].clone()


# ---- grouped GEMM ----

@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    n, k, num_pairs, a_row_div,
    stride_am, stride_be, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """C[pair] = A[pair // a_row_div] @ B[expert].T (* routing weight of the pair) for one
    BLOCK_M x BLOCK_N tile of one expert's block of pairs."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):
        pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pairs < num_pairs
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = (pairs // a_row_div).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
        b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            k_ok = ks + k0 < k
            a = tl.load(a_ptrs + k0, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
        c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def _moe_gemm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
    sorted_ids: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor,
    a_row_div: int, block_m: int,
) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n, block_k = 64, 64
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_ids, block_expert, num_padded,
        n, k, out.shape[0], a_row_div, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MUL_WEIGHT=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4 if block_m <= 16 else 8)


@graph_op("fused_moe", lambda x, w13, w2, topk_weights, topk_ids: x.new_empty(x.shape))
def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Same as `fused_moe_ref`: x [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]."""
    t, h = x.shape
    top_k = topk_ids.shape[1]
    e, two_i, _ = w13.shape
    if t == 0:
        return torch.zeros_like(x)
    for w in (w13, w2):
        if w.stride(-1) != 1:
            raise ValueError("expert weights must have unit stride along their input dimension")
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = 16 if t * top_k <= 4 * e else 64
    sorted_ids, block_expert, num_padded = align_by_expert(topk_ids, e, block_m)
    pairs = t * top_k
    gate_up = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, gate_up, None, sorted_ids, block_expert, num_padded, top_k, block_m)
    act = silu_and_mul(gate_up)
    down = torch.empty(pairs, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.to(x.dtype).float().flatten().contiguous()  # rounded like the reference
    _moe_gemm(act, w2, down, weights, sorted_ids, block_expert, num_padded, 1, block_m)
    return down.view(t, top_k, h).sum(dim=1)
