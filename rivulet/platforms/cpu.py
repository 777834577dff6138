"""The CPU platform: always present; bf16 activations are the fast path on AVX-512 machines."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
import weakref

import torch
from torch import nn

from rivulet.platforms.interface import Platform

logger = logging.getLogger(__name__)

_HUGE = 2 << 20  # the x86-64 transparent huge page
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


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
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # a storage of its own (offset 0), not a slice of the mapping: a compiled graph guards its inputs'
    # storage offsets, which a slice would take from wherever mmap put the mapping (the tensor keeps `mm` alive)
    return torch.frombuffer(mm, dtype=torch.uint8, offset=start, count=nbytes)


class Prefaulter(threading.Thread):
    """Faults in the pages of some buffers at idle priority (`SCHED_IDLE`: it runs only on a core
    nothing else wants, so it never delays a step), the first 2 MiB of every region, then the next.

    A page's first write costs a fault that zeroes it; in a VM whose host reclaims free guest memory
    (free page reporting) a 2 MiB page measured ~100-120 MB/s, so a 2 GB KV cache written first by
    the steps themselves cost the 64-stream step ~25% while its pages were new. The KV cache's
    regions are laid out block by block and the block pool hands out fresh blocks in id order, so
    this walks the cache in the order steps will reach it. It holds only weak references: a freed
    buffer ends it.
    """

    def __init__(self, regions: list[torch.Tensor], chunk: int = _HUGE) -> None:
        super().__init__(name="rivulet-prefault", daemon=True)
        bases = [r if r._base is None else r._base for r in regions]  # views die young: follow their bases
        self._regions = [(weakref.ref(b), r.data_ptr() - b.data_ptr()) for r, b in zip(regions, bases)]
        self._sizes = [r.numel() * r.element_size() for r in regions]
        self._chunk = chunk
        self.populated = 0  # bytes faulted in so far
        self.seconds = 0.0

    def run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except (AttributeError, OSError):
            pass
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        t0 = time.perf_counter()
        for offset in range(0, max(self._sizes, default=0), self._chunk):
            for (ref, start_in_base), size in zip(self._regions, self._sizes):
                if offset >= size:
                    continue
                base = ref()
                if base is None:  # freed: stop
                    return
                addr = base.data_ptr() + start_in_base + offset
                n = min(self._chunk, size - offset)
                del base
                page = addr & ~4095  # madvise takes page-aligned starts
                if libc.madvise(page, n + addr - page, _MADV_POPULATE_WRITE) != 0:
                    logger.debug("prefault stopped: madvise errno %d", ctypes.get_errno())
                    return  # an older kernel: pages fault in on first write, as without this
                self.populated += n
        self.seconds = time.perf_counter() - t0
        logger.info("KV cache memory faulted in (%.0f MiB) in %.1f s, in idle time",
                    self.populated / 2**20, self.seconds)


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
    # prefill is compute-bound here and its GEMMs reach their rate by 512 rows, so two long prompts in one
    # step only make both wait for the sum: long prompts go one after another in 512-token chunks (mean
    # TTFT ~0.78x at 8 streams of 1024-token prompts; short prompts still batch: benchmarks/RESULTS.md)
    long_prefill_token_threshold = 512

    @classmethod
    def is_available(cls) -> bool:
        return True

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)  # fp16 matmuls are emulated and slow on CPU

    def free_memory_bytes(self) -> int:
        return _meminfo_available()

    def kv_cache_budget(self, utilization: float) -> int:
        """A share of the available host memory, at most 2 GiB: the rest stays with the system
        (`--kv-cache-memory` sets any size)."""
        return min(int(self.free_memory_bytes() * utilization), 2 << 30)

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

    def prefault(self, regions: list[torch.Tensor]) -> Prefaulter | None:
        if not hasattr(os, "SCHED_IDLE"):  # not Linux: first writes fault pages in, as ever
            return None
        thread = Prefaulter(regions)
        thread.start()
        return thread

    def place_module(self, module: nn.Module) -> None:
        """Copy every parameter and buffer (shared ones once) into one huge-page arena, but for
        weights a kernel packed for itself (a module's `packed_params`, and oneDNN's opaque
        tensors): streamed front to back once per step, they measured no faster in huge pages, whose
        faults cost start-up time (the packed bf16 weights of the default model 1.65 s: fresh 2 MiB
        pages fault in at ~100-120 MB/s in this VM, docs/cpu.md). Parameters that only row lookups
        read stay too (a module's `gathered_params`: the embedding table, unless a tied LM head
        reads it whole): a lookup touches a few rows. Buffers the forward writes (a module's
        `written_buffers`, e.g. MoE routing counts) stay too: a compiled graph cannot write an input
        whose storage it shares with inputs of another dtype (AOTAutograd refuses the aliasing)."""
        stays: dict[int, bool] = {}
        for m in module.modules():
            gathered = (*getattr(m, "gathered_params", ()), *getattr(m, "packed_params", ()))
            for name, p in m.named_parameters(recurse=False):
                stays[id(p)] = stays.get(id(p), True) and name in gathered
            for name in getattr(m, "written_buffers", ()):
                stays[id(getattr(m, name))] = True
        tensors: dict[int, torch.Tensor] = {}
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type == "cpu" and t.numel() and not t.is_mkldnn and not stays.get(id(t)):
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
