"""What every platform tells the layers above it."""

from __future__ import annotations

import torch


class Platform:
    """A device kind: its name, default dtype, memory and the attention backend it uses."""

    name: str = "base"
    device_type: str = "cpu"
    default_dtype: torch.dtype = torch.bfloat16
    dist_backend: str = "gloo"
    # whether the host is free while the device computes, so the engine schedules the next step then
    # (async scheduling's default)
    computes_apart_from_host: bool = True
    # SchedulerConfig.long_prefill_token_threshold when the user does not say (None: off)
    long_prefill_token_threshold: int | None = None

    @classmethod
    def is_available(cls) -> bool:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def free_memory_bytes(self) -> int:
        """Memory that a KV cache could still take, in bytes."""
        raise NotImplementedError

    def kv_cache_budget(self, utilization: float) -> int:
        """Bytes for the KV cache once the model is loaded, at `--gpu-memory-utilization` (by default a share
        of the free memory)."""
        return int(self.free_memory_bytes() * utilization)

    def attention_backend(self) -> str:
        """Name of the paged-attention implementation in `rivulet.kernels.attention`."""
        return "torch"

    def kernel_backend(self) -> str:
        """Which implementations `rivulet.kernels.ops.get_op` hands out ("torch": the references)."""
        return "torch"

    def synchronize(self) -> None:
        pass

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A large long-lived zeroed buffer on this device (the KV cache)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def place_module(self, module: torch.nn.Module) -> None:
        """Move a loaded model's tensors to where this platform reads them fastest (nothing by default)."""

    def prefault(self, regions: list[torch.Tensor]) -> object | None:
        """Fault in the memory of buffers from `zeros` before it is first written, where first touches
        are slow (host memory); returns a handle with `join()` when that work runs in the background.
        Nothing by default (device memory is backed when allocated)."""
        return None
