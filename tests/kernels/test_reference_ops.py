"""Kernel references against independent formulations, and fast versions against the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rivulet.kernels import (
    apply_rotary_ref,
    fused_add_rms_norm_ref,
    fused_moe_ref,
    paged_attention_ref,
    rope_cos_sin_cache,
    silu_and_mul_ref,
    topk_routing_ref,
    write_kv_cache_ref,
)
from rivulet.kernels.activation import gelu_tanh_and_mul_ref
from rivulet.kernels.cpu.attention import paged_attention_cpu
from rivulet.worker.batch import SeqChunk, build_flat_batch

g = torch.Generator().manual_seed(0)


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def _paged_setup(chunks_spec, hq=6, hk=2, d=16, block_size=4, num_blocks=64, dtype=torch.float32):
    """Random K/V for each sequence's whole context written through the slot mapping; returns
    (query, cache, meta, dense per-sequence K/V/positions)."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    chunks, dense = [], []
    for n_computed, n_new in chunks_spec:
        total = n_computed + n_new
        nb = -(-total // block_size)
        table, perm = perm[:nb], perm[nb:]
        chunks.append(SeqChunk([0] * n_new, n_computed, table))
        dense.append((_randn(total, hk, d, dtype=dtype), _randn(total, hk, d, dtype=dtype)))
    cache = torch.zeros(2, num_blocks, block_size, hk, d, dtype=dtype)
    for c, (k, v) in zip(chunks, dense):  # whole contexts, as earlier steps would have written them
        full = build_flat_batch([SeqChunk([0] * (c.num_computed + len(c.token_ids)), 0, c.block_table)],
                                block_size, torch.device("cpu"))
        write_kv_cache_ref(k, v, cache, full.meta.slot_mapping)
    batch = build_flat_batch(chunks, block_size, torch.device("cpu"))
    q = _randn(len(batch.input_ids), hq, d, dtype=dtype)
    return q, cache, batch.meta, dense


SPECS = [[(0, 7)], [(5, 1)], [(0, 9), (12, 1), (3, 4), (30, 1), (0, 1)], [(8, 1), (17, 1), (2, 1)]]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (5, 0.0), (None, 0.7), (5, 0.7)])
def test_paged_attention_ref_equals_dense_causal_attention(spec, window, softcap):
    q, cache, meta, dense = _paged_setup(spec)
    out = paged_attention_ref(q, cache, meta, 0.25, window, softcap)
    qsl = meta.query_start_loc.tolist()
    for i, ((k, v), (n_computed, n_new)) in enumerate(zip(dense, spec)):
        total = n_computed + n_new
        qi = q[qsl[i]:qsl[i + 1]]
        scores = torch.einsum("qhd,khd->hqk", qi, k.repeat_interleave(3, dim=1)) * 0.25
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qp, kp = torch.arange(n_computed, total)[:, None], torch.arange(total)[None, :]
        allowed = (kp <= qp) & ((qp - kp < window) if window else True)
        p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        want = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(3, dim=1))
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (6, 0.0), (6, 0.7)])
def test_cpu_backend_matches_reference(spec, dtype, window, softcap):
    q, cache, meta, _ = _paged_setup(spec, dtype=dtype)
    want = paged_attention_ref(q, cache, meta, 0.25, window, softcap)
    got = paged_attention_cpu(q, cache, meta, 0.25, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_write_kv_cache_places_tokens_in_their_slots():
    cache = torch.zeros(2, 8, 4, 2, 3)
    k, v = _randn(3, 2, 3), _randn(3, 2, 3)
    write_kv_cache_ref(k, v, cache, torch.tensor([5, 30, 0]))
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[0, 7, 2], k[1]) and torch.equal(cache[1, 0, 0], v[2])
    assert cache.abs().sum() == k.abs().sum() + v.abs().sum()


def test_rms_norm_with_residual():
    x, r, w = _randn(5, 32), _randn(5, 32), _randn(32)
    out, res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    s = x + r
    torch.testing.assert_close(res, s)
    torch.testing.assert_close(out, s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w)


def test_silu_and_mul():
    x = _randn(4, 10)
    torch.testing.assert_close(silu_and_mul_ref(x), x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:])


def test_gelu_tanh_and_mul():
    x = _randn(4, 10)
    g = x[:, :5]
    want = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * x[:, 5:]
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), want)


def test_rotary_styles_are_a_permutation_of_each_other():
    """Interleaved RoPE on (x0, x1, x2, x3, ...) equals neox RoPE on (x0, x2, ..., x1, x3, ...)."""
    d, t = 8, 6
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cache = rope_cos_sin_cache(inv, 32)
    pos = torch.tensor([0, 3, 7, 8, 20, 31])
    q, k = _randn(t, 2, d), _randn(t, 1, d)
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    qi, ki = apply_rotary_ref(pos, q, k, cache, interleaved=True)
    qn, kn = apply_rotary_ref(pos, q[..., perm], k[..., perm], cache, interleaved=False)
    torch.testing.assert_close(qi[..., perm], qn)
    torch.testing.assert_close(ki[..., perm], kn)
    # position 0 is the identity and norms are preserved
    torch.testing.assert_close(qi[0], q[0])
    torch.testing.assert_close(qi.norm(dim=-1), q.norm(dim=-1))


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_equals_dense_mixture(renormalize):
    t, h, i, e, k = 7, 16, 12, 5, 2
    x, w13, w2 = _randn(t, h), _randn(e, 2 * i, h) * 0.3, _randn(e, h, i) * 0.3
    logits = _randn(t, e)
    weights, ids = topk_routing_ref(logits, k, renormalize)
    probs = logits.softmax(-1)
    assert torch.equal(ids.sort(-1).values, probs.topk(k).indices.sort(-1).values)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(t))
    dense = torch.zeros(t, e)
    dense.scatter_(1, ids, weights)
    want = sum(dense[:, j:j + 1] * F.linear(silu_and_mul_ref(F.linear(x, w13[j])), w2[j]) for j in range(e))
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)
