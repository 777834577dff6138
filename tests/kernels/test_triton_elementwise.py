"""Triton RMSNorm (+residual), SiLU/GELU-and-mul, rotary embedding and KV-cache write vs their references."""

from __future__ import annotations

import pytest
import torch

from triton_helpers import DEVICE, DTYPES, close, randn

from rivulet.kernels import (
    apply_rotary_ref,
    fused_add_rms_norm_ref,
    rms_norm_ref,
    rope_cos_sin_cache,
    silu_and_mul_ref,
    write_kv_cache_ref,
)
from rivulet.kernels.activation import gelu_tanh_and_mul_ref
from rivulet.kernels.attention import rotary_write_kv_cache_ref
from rivulet.kernels.bitmask import apply_token_bitmask_ref
from rivulet.kernels.triton.activation import gelu_tanh_and_mul, silu_and_mul
from rivulet.kernels.triton.bitmask import apply_token_bitmask
from rivulet.kernels.triton.kv_cache import write_kv_cache
from rivulet.kernels.triton.norm import fused_add_rms_norm, rms_norm
from rivulet.kernels.triton.rotary import apply_rotary, rotary_write_kv_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 80), (1, 200)])
def test_rms_norm(shape, dtype):
    x, w = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype)
    close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (5, 200)])
def test_fused_add_rms_norm(shape, dtype):
    x, r, w = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    out, res = fused_add_rms_norm(x, r, w, 1e-6)
    want_out, want_res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    close(out, want_out, dtype)
    close(res, want_res, dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"


def test_rms_norm_strided_rows():
    """A column slice (row stride larger than the width) is read in place."""
    x, w = randn(6, 96), randn(64)
    close(rms_norm(x[:, :64], w, 1e-6), rms_norm_ref(x[:, :64], w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 96), (2, 3, 2 * 40), (1, 2 * 1500)])
def test_silu_and_mul(shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    close(silu_and_mul(x), silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 96), (1, 2 * 1500)])
def test_gelu_tanh_and_mul(shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("hq,hk,d,rot", [(4, 4, 64, 64), (12, 4, 128, 128), (6, 2, 80, 40), (3, 1, 96, 48)])
def test_rotary(hq, hk, d, rot, interleaved, dtype):
    t, max_pos = 9, 100
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cache = rope_cos_sin_cache(inv_freq, max_pos).to(DEVICE)
    positions = torch.randint(0, max_pos, (t,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    qkv = randn(t, (hq + 2 * hk) * d, dtype=dtype)  # q and k as strided views of a fused projection
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    got_q, got_k = apply_rotary(positions, q, k, cache, interleaved)
    want_q, want_k = apply_rotary_ref(positions, q, k, cache, interleaved)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("hq,hk,d,rot", [(4, 4, 64, 64), (6, 2, 80, 40), (3, 1, 96, 48)])
def test_rotary_write_kv_cache(hq, hk, d, rot, interleaved, dtype):
    """The fused op returns the rotated queries and fills the cache like the reference composition;
    q/k/v are views of one projection; a negative slot writes nothing."""
    t, max_pos, num_blocks, block_size = 9, 100, 6, 4
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cs = rope_cos_sin_cache(inv_freq, max_pos).to(DEVICE)
    positions = torch.randint(0, max_pos, (t,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q, k, v = randn(t, (hq + 2 * hk) * d, dtype=dtype).split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(5))[:t].to(DEVICE)
    slots[4] = -1
    want = randn(2, num_blocks, block_size, hk, d, dtype=dtype)
    got = want.clone()
    keep = slots >= 0
    want_q = rotary_write_kv_cache_ref(positions[keep], q[keep], k[keep], v[keep], cs, interleaved, want, slots[keep])
    got_q = rotary_write_kv_cache(positions, q, k, v, cs, interleaved, got, slots)
    close(got_q[keep], want_q, dtype)
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,d,block_size", [(2, 64, 16), (4, 128, 16), (1, 80, 8)])
def test_write_kv_cache(hk, d, block_size, dtype):
    num_blocks, t = 10, 23
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(5))[:t].to(DEVICE)
    kv = randn(t, 2 * hk * d, dtype=dtype)  # strided views, as split from a fused projection
    key, value = kv[:, : hk * d].view(t, hk, d), kv[:, hk * d:].view(t, hk, d)
    want = randn(2, num_blocks, block_size, hk, d, dtype=dtype)
    got = want.clone()
    write_kv_cache_ref(key, value, want, slots)
    write_kv_cache(key, value, got, slots)
    assert torch.equal(got, want)


def test_write_kv_cache_skips_negative_slots():
    key, value = randn(3, 2, 16), randn(3, 2, 16)
    cache = randn(2, 4, 4, 2, 16)
    before = cache.clone()
    write_kv_cache(key, value, cache, torch.tensor([5, -1, 9], device=DEVICE))
    write_kv_cache_ref(key[[0, 2]], value[[0, 2]], before, torch.tensor([5, 9], device=DEVICE))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("rows, vocab", [(3, 70), (2, 2100)])
def test_apply_token_bitmask(rows, vocab):
    """Random masks, a row allowing everything, the last word partly past the vocabulary."""
    g = torch.Generator().manual_seed(rows)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    mask[-1] = -1
    logits = randn(rows, vocab, dtype=torch.float32)
    want = apply_token_bitmask_ref(logits.clone(), mask.to(logits.device))
    got = apply_token_bitmask(logits.clone(), mask.to(logits.device))
    assert torch.equal(got, want) and bool(torch.isinf(want).any()) and not bool(torch.isinf(want[-1]).any())


@pytest.mark.parametrize("vocab", [3000, 5000])
def test_sample_rows_is_the_reference_race(vocab):
    """The Triton race draws the reference's tokens (same keys): sampled rows, greedy rows (temperature 0), and a
    vocabulary that ends inside a block; a row's winner sits in any of its blocks."""
    from rivulet.kernels.sampling import sample_rows_ref
    from rivulet.kernels.triton.sampling import sample_rows

    rows = 12
    logits = randn(rows, vocab, dtype=torch.float32, scale=2.0)
    temperature = (torch.rand(rows, generator=torch.Generator().manual_seed(vocab)) + 0.3).to(DEVICE)
    temperature[::4] = 0.0
    keys = torch.randint((1 << 63) - 1, (rows,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = sample_rows(logits, temperature, keys)
    want = sample_rows_ref(logits, temperature, keys)
    assert torch.equal(got, want) and len(set((got // 1024).tolist())) > 1
