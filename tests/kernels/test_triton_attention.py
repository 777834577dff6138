"""Triton paged attention vs `paged_attention_ref` on mixed batches of prefill chunks and decodes."""

from __future__ import annotations

import pytest
import torch

from triton_helpers import DEVICE, DTYPES, close, randn

from rivulet.kernels import paged_attention_ref
from rivulet.kernels.attention import get_attention_backend
from rivulet.kernels.triton.attention import paged_attention
from rivulet.worker.batch import SeqChunk, build_flat_batch


def _setup(spec: list[tuple[int, int]], hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    """A random cache (every slot random, so stray reads show) and a flat batch of `spec`
    (cached tokens, new tokens) per sequence, with blocks scattered over the cache."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // block_size) for c, n in spec)
    num_blocks = need + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()
    chunks = []
    for n_cached, n_new in spec:
        nb = -(-(n_cached + n_new) // block_size)
        table, perm = perm[:nb], perm[nb:]
        chunks.append(SeqChunk([0] * n_new, n_cached, table))
    batch = build_flat_batch(chunks, block_size, DEVICE)
    cache = randn(2, num_blocks, block_size, hk, d, dtype=dtype)
    q = randn(len(batch.input_ids), hq, d, dtype=dtype)
    return q, cache, batch.meta


MIXED = [(0, 13), (21, 1), (5, 9), (40, 1), (0, 1), (16, 17)]  # prefills, chunked prefills, decodes
DECODE = [(20, 1), (3, 1), (47, 1), (0, 1), (16, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(4, 4, 64), (6, 2, 128), (8, 2, 80), (3, 1, 64)])  # GQA 1, 3, 4, 3
@pytest.mark.parametrize("spec", [MIXED, DECODE], ids=["mixed", "decode"])
def test_paged_attention_matches_reference(spec, hq, hk, d, dtype):
    q, cache, meta = _setup(spec, hq, hk, d, 16, dtype)
    close(paged_attention(q, cache, meta, d**-0.5), paged_attention_ref(q, cache, meta, d**-0.5), dtype)


@pytest.mark.parametrize("window", [1, 7])
@pytest.mark.parametrize("spec", [MIXED, DECODE], ids=["mixed", "decode"])
def test_paged_attention_sliding_window(spec, window):
    q, cache, meta = _setup(spec, 4, 2, 64, 16, torch.float32, seed=1)
    close(paged_attention(q, cache, meta, 0.1, window), paged_attention_ref(q, cache, meta, 0.1, window), torch.float32)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("spec", [MIXED, DECODE], ids=["mixed", "decode"])
def test_paged_attention_softcap(spec, window):
    """Gemma 2's capped scores: cap * tanh(scores / cap), a cap low enough to change every row."""
    q, cache, meta = _setup(spec, 4, 2, 64, 16, torch.float32, seed=4)
    want = paged_attention_ref(q, cache, meta, 0.3, window, 1.5)
    assert (want - paged_attention_ref(q, cache, meta, 0.3, window)).abs().max() > 1e-2
    close(paged_attention(q, cache, meta, 0.3, window, 1.5), want, torch.float32)


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("window", [None, 9])
def test_split_k_decode(segments, window):
    """The split-K path (forced, with segments that may be empty) equals the single pass."""
    q, cache, meta = _setup(DECODE, 6, 2, 64, 8, torch.float32, seed=2)
    want = paged_attention_ref(q, cache, meta, 0.125, window)
    close(paged_attention(q, cache, meta, 0.125, window, num_segments=segments), want, torch.float32)


def test_block_size_not_tile_multiple():
    """Cache blocks of 4 tokens: a key tile spans several blocks."""
    q, cache, meta = _setup([(9, 6), (30, 1)], 4, 1, 64, 4, torch.float32, seed=3)
    close(paged_attention(q, cache, meta, 0.2), paged_attention_ref(q, cache, meta, 0.2), torch.float32)


def test_registered_as_backend():
    assert get_attention_backend("triton") is paged_attention


@pytest.mark.parametrize("spec", [MIXED, DECODE], ids=["mixed", "decode"])
def test_latent_cache_mla(spec):
    """DeepSeek's MLA: one cached vector per token read as key and value (a stride-0 [2, ...] view), 8 heads
    sharing it; the latent part of the output equals the reference on the same view."""
    q, cache, meta = _setup(spec, 8, 1, 40, 16, torch.float32, seed=6)
    both = cache[:1].expand(2, -1, -1, -1, -1)
    assert both.stride(0) == 0
    close(paged_attention(q, both, meta, 0.2)[..., :32], paged_attention_ref(q, both, meta, 0.2)[..., :32],
          torch.float32)
