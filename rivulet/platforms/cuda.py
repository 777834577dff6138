"""The CUDA platform (NVIDIA GPUs)."""

from __future__ import annotations

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
        free, _total = torch.cuda.mem_get_info()
        return int(free)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
