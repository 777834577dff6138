"""The CPU platform: always present; bf16 activations are the fast path on AVX-512 machines."""

from __future__ import annotations

import torch

from rivulet.platforms.interface import Platform


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    default_dtype = torch.bfloat16
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)  # fp16 matmuls are emulated and slow on CPU

    def free_memory_bytes(self) -> int:
        return _meminfo_available()

    def attention_backend(self) -> str:
        return "cpu"

    def kernel_backend(self) -> str:
        """"cpu": the C++ kernels of `rivulet.kernels.cpu` (the references where they are missing)."""
        return "cpu"
