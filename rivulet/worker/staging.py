"""Host-to-device moves of a step's inputs: one pinned host buffer per device buffer, one copy each.

A step's inputs are small integer arrays built on the host (token ids, positions, slots, block tables,
sequence lengths). Copied one by one from pageable memory, each would be a blocking copy (torch waits
for the stream to drain); here every array of one dtype is written into one pinned host buffer
(`Mirror.host`) and moved by a single non-blocking copy into a device buffer that persists across
steps (`Mirror.device_buf`). The copy is ordered on the current stream before the step's kernels, and
a kernel of an earlier step that reads the device buffer ran before it on the same stream, so reusing
it is safe; the host buffer is reused only once the event recorded after its copy has passed.

On the CPU there is nothing to move: `Staging` hands out the arrays themselves as tensors (fresh each
step), and a `Mirror`'s host buffer is its device buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def to_device(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host array as a tensor on `device` without waiting for the device: on the CPU the array itself;
    elsewhere a copy in pinned memory (from torch's caching host allocator, which keeps the block until the
    copy is done) moved by a non-blocking copy. A plain `.to(device)` from pageable memory waits for
    everything queued on the stream first."""
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class Mirror:
    """A host buffer (pinned where the device is not the CPU) and the device buffer it is copied to, both 1-D
    of `numel` elements of `dtype`. `copy=True` keeps two buffers on the CPU too (tests of the copying path)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, copy: bool | None = None) -> None:
        self.dtype, self.device = dtype, device
        self.copies = device.type != "cpu" if copy is None else copy
        cuda = device.type == "cuda"
        with torch.inference_mode(False):  # plain tensors, usable in and out of inference mode
            self.host = torch.zeros(numel, dtype=dtype, pin_memory=cuda)
            self.device_buf = torch.zeros(numel, dtype=dtype, device=device) if self.copies else self.host
        self.np = self.host.numpy()
        self._copied = torch.cuda.Event() if cuda else None

    @property
    def numel(self) -> int:
        return self.host.numel()

    def writable(self) -> np.ndarray:
        """The host buffer as numpy, once its last copy to the device has been done."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.np

    def push(self, n: int) -> torch.Tensor:
        """Copy the first `n` elements to the device (non-blocking from pinned memory); the device buffer."""
        if self.copies and n:
            self.device_buf[:n].copy_(self.host[:n], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
        return self.device_buf


class Staging:
    """Moves groups of host arrays to the device: each group (one dtype) is packed into a `Mirror` that grows as
    needed and copied at once; the tensors returned are views of its device buffer, valid until the group after
    next of that dtype. Each dtype has a ring of `RING` mirrors, used in turn: a move waits only for the copy
    made `RING` moves before (long done), never for one queued behind the device's current work."""

    RING = 4

    def __init__(self, device: torch.device, copy: bool | None = None) -> None:
        self.device = device
        self.copies = device.type != "cpu" if copy is None else copy
        self._rings: dict[torch.dtype, list[Mirror | None]] = {}
        self._turn: dict[torch.dtype, int] = {}

    def move(self, arrays: Sequence[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """Device tensors with the values and shapes of `arrays`, as `dtype`."""
        if not self.copies:  # the CPU: the arrays themselves (converted where the dtype differs)
            np_dtype = _NUMPY[dtype]
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np_dtype)) for a in arrays]
        sizes = [a.size for a in arrays]
        starts = aligned_offsets(sizes, dtype)
        total = starts[-1] + sizes[-1] if sizes else 0
        ring = self._rings.setdefault(dtype, [None] * self.RING)
        turn = self._turn[dtype] = (self._turn.get(dtype, -1) + 1) % self.RING
        m = ring[turn]
        if m is None or m.numel < total:
            m = ring[turn] = Mirror(max(total, 2 * m.numel if m else 1024), dtype, self.device, copy=True)
        buf = m.writable()
        for a, k, off in zip(arrays, sizes, starts):
            buf[off:off + k] = a.reshape(-1)
        dev = m.push(total)
        return [dev[off:off + k].view(a.shape) for a, k, off in zip(arrays, sizes, starts)]


ALIGN_BYTES = 16  # Triton specializes kernels on 16-byte aligned pointers: a packed view must stay aligned


def aligned_offsets(sizes: Sequence[int], dtype: torch.dtype) -> list[int]:
    """Element offsets of arrays of `sizes` packed one after another, each starting 16-byte aligned."""
    unit = max(ALIGN_BYTES // dtype.itemsize, 1)
    out, off = [], 0
    for k in sizes:
        out.append(off)
        off += -(-k // unit) * unit
    return out
