"""The KV cache's share of memory (`--gpu-memory-utilization`): on CUDA, what this process may still take (its share
where processes share a GPU; torch.cuda's readings replaced, so it runs without one), and on CPU."""

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


@pytest.mark.parametrize("utilization, fraction, free, reserved, want", [
    (0.9, 1.0, 60 * GiB, 16 * GiB, 56 * GiB),  # 90% of 80 GiB in all, the weights (16) held already
    (0.5, 1.0, 60 * GiB, 16 * GiB, 24 * GiB),
    (0.9, 1.0, 20 * GiB, 16 * GiB, 20 * GiB),  # another process holds the rest: no more than is free
    (0.9, 0.25, 60 * GiB, 16 * GiB, 4 * GiB),  # the per-process limit is lower than the utilization
    (0.1, 1.0, 60 * GiB, 16 * GiB, 0),  # the weights alone are over the share: no blocks (the engine says so)
])
def test_kv_cache_budget_is_vllms_gpu_memory_utilization(monkeypatch, utilization, fraction, free, reserved,
                                                         want) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda: fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: reserved)
    assert CudaPlatform().kv_cache_budget(utilization) == want


def test_gpu_memory_utilization_sizes_the_cpu_kv_cache_and_is_checked(monkeypatch, tiny_model_dir) -> None:
    """On CPU the share applies to the available host memory (the KV cache at most 2 GiB); out-of-range values
    are refused with the flag's name."""
    from rivulet import LLM
    from rivulet.config import RivuletError
    from rivulet.platforms import cpu

    path, _ = tiny_model_dir("llama")
    monkeypatch.setattr(cpu, "_meminfo_available", lambda: 64 << 20)  # 64 MiB available
    llm = LLM(str(path), dtype="float32", gpu_memory_utilization=0.25, max_model_len=64)
    runner = llm.engine.core.executor.runner
    assert llm.engine.core.num_blocks == (16 << 20) // runner.kv_bytes_per_block()
    llm.shutdown()
    for bad in (0, 1.5, "0.5", True):
        with pytest.raises(RivuletError, match="gpu_memory_utilization"):
            LLM(str(path), gpu_memory_utilization=bad)
