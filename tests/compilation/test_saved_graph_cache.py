"""A saved graph serves a KV cache wherever the platform allocates it (sizes: test_compile.py)."""

from __future__ import annotations

import pytest
import torch

from rivulet.platforms import current_platform


@pytest.mark.parametrize("nbytes", [4096, 1 << 21, (1 << 21) + 4096, 3 * (1 << 20) + 64])
def test_kv_cache_tensors_begin_their_storage(nbytes):
    """Dynamo guards a tensor input's storage offset (0/1 specialization, equal offsets of two caches merged
    into one symbol), so a cache placed at another offset in the next process would fail a saved graph's
    guards; tensors of their own storage have offset 0 wherever their memory lies."""
    caches = [current_platform().zeros((2, nbytes // 64, 4, 2), torch.float32) for _ in range(3)]
    assert [c.storage_offset() for c in caches] == [0, 0, 0]
    assert all(c.untyped_storage().nbytes() == c.numel() * 4 for c in caches)
    caches[0].fill_(1.0)
    assert caches[1].sum() == 0 and caches[0].sum() == caches[0].numel()

