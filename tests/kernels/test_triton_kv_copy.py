"""Triton batched block copies (the KV tier on a GPU) against the reference: between caches on one device in
one launch, and between the device and the host through one staging transfer. Copies move words, not
values, so bfloat16 runs in the interpreter too and every result is bit-exact."""

from __future__ import annotations

import pytest
import torch

from triton_helpers import DEVICE, randn

from rivulet.kernels.kv_copy import copy_blocks_ref
from rivulet.kernels.triton.kv_copy import copy_blocks, copy_through_staging

BLOCKS, SLOTS = torch.tensor([39, 0, 7, 12, 3]), torch.tensor([16, 2, 0, 9, 5])


def _layers(halves: int, blocks: int, dtype: torch.dtype, device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(halves, blocks, 4, 3, 8, generator=g).to(dtype).to(device) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("halves", [2, 1])  # keys and values; a latent cache (MLA)
def test_copy_blocks_on_one_device(dtype: torch.dtype, halves: int) -> None:
    caches, other = _layers(halves, 40, dtype, DEVICE, 0), _layers(halves, 17, dtype, DEVICE, 1)
    for src, dst, a, b in [(caches, other, BLOCKS, SLOTS), (other, caches, SLOTS, BLOCKS)]:
        want = [t.clone() for t in dst]
        copy_blocks_ref(src, want, a, b)
        copy_blocks(src, dst, a, b)
        assert all(torch.equal(x, y) for x, y in zip(dst, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_through_staging_between_device_and_host(dtype: torch.dtype) -> None:
    caches, host = _layers(2, 40, dtype, DEVICE, 2), _layers(2, 17, dtype, torch.device("cpu"), 3)
    for src, dst, a, b in [(caches, host, BLOCKS, SLOTS), (host, caches, SLOTS, BLOCKS)]:
        want = [t.clone() for t in dst]
        copy_blocks_ref(src, want, a, b)
        copy_through_staging(src, dst, a, b)
        assert all(torch.equal(x, y) for x, y in zip(dst, want))


def test_layers_of_other_shapes_take_the_reference() -> None:
    src = [randn(2, 10, 4, 3, 8), randn(2, 10, 4, 1, 24)]
    dst = [torch.zeros(2, 5, 4, 3, 8, device=DEVICE), torch.zeros(2, 5, 4, 1, 24, device=DEVICE)]
    want = [t.clone() for t in dst]
    copy_blocks_ref(src, want, torch.tensor([9, 1]), torch.tensor([0, 4]))
    copy_blocks(src, dst, torch.tensor([9, 1]), torch.tensor([0, 4]))
    assert all(torch.equal(x, y) for x, y in zip(dst, want))


def test_out_of_range_blocks_are_refused() -> None:
    caches, other = _layers(2, 40, torch.float32, DEVICE, 0), _layers(2, 17, torch.float32, DEVICE, 1)
    with pytest.raises(IndexError, match="out of range"):
        copy_blocks(caches, other, torch.tensor([1]), torch.tensor([17]))
