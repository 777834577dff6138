"""The CPU platform: always present; bf16 activations are the fast path on AVX-512 machines."""

from __future__ import annotations

import ctypes
import mmap

import torch
from torch import nn

from rivulet.platforms.interface import Platform

_HUGE = 2 << 20  # the x86-64 transparent huge page


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of `nbytes` in anonymous memory advised for transparent huge pages.

    Decode reads the weights and the KV pages of every sequence once per step; with 4 KiB pages
    those reads miss the TLB at almost every KV page and often in the weights. Huge pages measured
    1.4x faster decode attention over scattered pages and ~15% faster whole steps here. Where the
    kernel refuses the advice the memory is ordinary (and as fast as before).
    """
    mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    start = -base % _HUGE  # a 2 MiB-aligned start, so every whole 2 MiB of the buffer can be one page
    return torch.frombuffer(mm, dtype=torch.uint8)[start:start + nbytes]  # the tensor keeps `mm` alive


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
    # the "device" is the host's own cores: a second busy thread takes a core from the OpenMP team and
    # stalls its barriers (async scheduling measured 1.3-1.4x slower steps at 64 streams on 2 cores)
    computes_apart_from_host = False

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

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return huge_page_bytes(n * dtype.itemsize).view(dtype).view(shape)

    def place_module(self, module: nn.Module) -> None:
        """Copy every parameter and buffer (shared ones once) into one huge-page arena; tensors in
        a kernel library's own layout (oneDNN's opaque packed weights) stay where they are, and so
        do parameters that only row lookups read (a module's `gathered_params`: the embedding
        table, unless a tied LM head reads it whole): a lookup touches a few rows, while faulting
        2 MiB pages in costs start-up time (the kernel compacts memory for them: 0.1-0.7 s for the
        default model's 56 MB table)."""
        gathered_only: dict[int, bool] = {}
        for m in module.modules():
            gathered = getattr(m, "gathered_params", ())
            for name, p in m.named_parameters(recurse=False):
                gathered_only[id(p)] = gathered_only.get(id(p), True) and name in gathered
        tensors: dict[int, torch.Tensor] = {}
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type == "cpu" and t.numel() and not t.is_mkldnn and not gathered_only.get(id(t)):
                tensors.setdefault(t.data_ptr(), t)
        if not tensors:
            return
        align = 64
        sizes = {k: -(-t.numel() * t.element_size() // align) * align for k, t in tensors.items()}
        arena = huge_page_bytes(sum(sizes.values()))
        offset = 0
        for k, t in tensors.items():
            n = t.numel() * t.element_size()
            dst = arena[offset:offset + n].view(t.dtype).view(t.shape)
            dst.copy_(t.detach().contiguous())
            t.data = dst
            offset += sizes[k]
