"""Multi-head latent attention (DeepSeek) on the attention backends: a cache of one vector per token,
[latent | rotary key], bound as keys and values at once (`MLAAttention`: a stride-0 view), against the
attention written out by hand: scores q . entry, output the softmax mix of the entries' latent parts."""

from __future__ import annotations

import pytest
import torch

from helpers.paged import scattered_batch
from rivulet.kernels import paged_attention_ref
from rivulet.kernels.cpu import load_cpu_ext
from rivulet.kernels.cpu.attention import paged_attention_cpu
from rivulet.layers.attention import MLAAttention

LATENT, ROPE, HEADS, BS = 32, 8, 4, 4
MIXED = [(20, 1), (0, 9), (3, 4), (47, 1), (16, 1), (0, 1)]  # decodes, a prefill, a chunk after cached tokens


def _case(spec: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    meta, num_blocks = scattered_batch(spec, BS, seed)
    g = torch.Generator().manual_seed(seed + 100)
    latent_cache = torch.randn(1, num_blocks, BS, 1, LATENT + ROPE, generator=g).to(dtype)
    q = torch.randn(len(meta.slot_mapping), HEADS, LATENT + ROPE, generator=g).to(dtype)
    return q, latent_cache, meta


def _by_hand(q: torch.Tensor, latent_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape[0], HEADS, LATENT)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for i, n in enumerate(lens):
        entries = latent_cache[0, meta.block_tables[i, :-(-n // BS)]].reshape(-1, LATENT + ROPE)[:n].float()
        qi = q[qsl[i]:qsl[i + 1]].float()  # [m, H, D]
        m = qi.shape[0]
        s = torch.einsum("mhd,nd->hmn", qi, entries) * scale
        causal = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        out[qsl[i]:qsl[i + 1]] = torch.einsum("hmn,nl->mhl", p, entries[:, :LATENT])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_latent_cache_attention_matches_by_hand(backend: str, dtype: torch.dtype) -> None:
    q, latent_cache, meta = _case(MIXED, dtype)
    both = latent_cache.expand(2, -1, -1, -1, -1)  # what MLAAttention binds: values are the keys
    fn = {"torch": paged_attention_ref, "cpu": paged_attention_cpu}[backend]
    got = fn(q, both, meta, 0.2)[..., :LATENT]
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), _by_hand(q, latent_cache, meta, 0.2), rtol=tol, atol=tol)


@pytest.mark.skipif(load_cpu_ext() is None, reason="the C++ kernels are not built here (the SDPA path is the only one)")
def test_cpu_sdpa_fallback_reads_the_shared_cache() -> None:
    """The paths the CPU backend takes without its C++ kernels, on the stride-0 cache."""
    q, latent_cache, meta = _case(MIXED, torch.float32, seed=1)
    both = latent_cache.expand(2, -1, -1, -1, -1)
    out = torch.empty_like(q)
    from rivulet.kernels.cpu.attention import plan_attention_cpu

    plan = plan_attention_cpu(meta.layout())
    torch.ops.rivulet.cpu_sdpa_decode(q, both, meta.block_tables, meta.seq_lens, plan["cpu_decode_rows"],
                                      plan["cpu_decode_seqs"], out, 0.2, 0, 0.0)
    torch.ops.rivulet.cpu_sdpa_prefill(q, both, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       plan["cpu_prefill_seqs"], out, 0.2, 0, 0.0)
    torch.testing.assert_close(out[..., :LATENT], _by_hand(q, latent_cache, meta, 0.2), rtol=2e-5, atol=2e-5)


def test_mla_layer_stores_one_vector_per_token_and_attends_over_it() -> None:
    """The layer writes this step's entries into its slots only (nothing else in the cache changes) and
    returns the latent part of the attention over them."""
    layer = MLAAttention(HEADS, LATENT, ROPE, 0.2)
    seen = []  # the backend reads keys and values from the same memory: a stride-0 view of the cache

    def backend(q, kv_cache, *args):
        seen.append((kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.stride(0)))
        return paged_attention_ref(q, kv_cache, *args)

    layer.backend = backend
    _, latent_cache, meta = _case([(0, 6), (5, 3)], torch.float32, seed=2)
    before = latent_cache.clone()
    layer.bind_kv_cache(latent_cache)
    assert layer.kv_cache is latent_cache
    g = torch.Generator().manual_seed(3)
    entries = torch.randn(9, LATENT + ROPE, generator=g)
    q = torch.randn(9, HEADS, LATENT + ROPE, generator=g)
    got = layer(q, entries, meta)
    flat, was = latent_cache[0].reshape(-1, LATENT + ROPE), before[0].reshape(-1, LATENT + ROPE)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[meta.slot_mapping] = True
    assert torch.equal(flat[meta.slot_mapping], entries) and torch.equal(flat[~written], was[~written])
    torch.testing.assert_close(got, _by_hand(q, latent_cache, meta, 0.2), rtol=2e-5, atol=2e-5)
    assert seen == [(latent_cache.data_ptr(), 2, 0)]
