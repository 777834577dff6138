"""The CUDA platform (NVIDIA GPUs): Triton kernels when Triton is installed, else the references."""

from __future__ import annotations

import importlib.util

import torch

from rivulet.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    default_dtype = torch.bfloat16
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def free_memory_bytes(self) -> int:
        """Free device memory this process may still take: the device's free memory, capped by the caching
        allocator's per-process limit (`torch.cuda.set_per_process_memory_fraction`) less what it holds, so
        processes sharing one GPU (test workers, several engines) each size their KV cache to their share."""
        return self.kv_cache_budget(1.0)

    def kv_cache_budget(self, utilization: float) -> int:
        """vLLM's `--gpu-memory-utilization`: this engine may hold `utilization` of the GPU's memory in all
        (weights, activations, the KV cache; what the process holds so far is taken off), and no more than
        is free, nor than the caching allocator's per-process limit allows."""
        free, total = torch.cuda.mem_get_info()
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda: 1.0)()
        return int(max(0, min(free, min(utilization, fraction) * total - torch.cuda.memory_reserved())))

    @staticmethod
    def has_triton() -> bool:
        return importlib.util.find_spec("triton") is not None

    def attention_backend(self) -> str:
        return "triton" if self.has_triton() else "torch"

    def kernel_backend(self) -> str:
        return "triton" if self.has_triton() else "torch"

    def synchronize(self) -> None:
        torch.cuda.synchronize()
