"""The CUDA platform's free memory: what this process may still take (its share where processes share a GPU).
The arithmetic only: torch.cuda's readings are replaced, so it runs without a GPU."""

from __future__ import annotations

import pytest
import torch

from rivulet.platforms.cuda import CudaPlatform

GiB = 1 << 30


@pytest.mark.parametrize("free, fraction, reserved, want", [
    (70 * GiB, 1.0, 10 * GiB, 70 * GiB),  # no per-process limit: the device's free memory
    (70 * GiB, 0.2, 4 * GiB, 12 * GiB),  # a worker's share of 80 GiB (16) less what it holds
    (5 * GiB, 0.5, 0, 5 * GiB),  # others took the rest of the device
    (70 * GiB, 0.1, 9 * GiB, 0),  # over its share already
])
def test_free_memory_is_the_process_share(monkeypatch, free, fraction, reserved, want) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda: fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: reserved)
    assert CudaPlatform().free_memory_bytes() == want
