"""Whole KV blocks between caches of one block shape, every layer in one launch (the KV tier's copies on a
GPU). Each layer is a [halves, blocks, ...] tensor with contiguous blocks; the kernel reads a table of the
layers' addresses, so one program copies one chunk of one (block pair, half, layer), whatever the dtype
(moved as integers of its size).

Between the device and the host, the blocks go through one contiguous staging tensor [layers, halves,
n, block elements]: gathered on the device by the kernel and copied to the host in one transfer (then
scattered into the host slots by the CPU op), or the reverse for a load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rivulet.kernels.kv_copy import copy_blocks_ref

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(src_ptrs, dst_ptrs, src_idx, dst_idx, src_half, dst_half, src_block, dst_block,
                        halves, elems, WORD: tl.constexpr, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    layer = tl.program_id(1)
    i = pair // halves
    h = (pair % halves).to(tl.int64)
    src = tl.load(src_ptrs + layer).to(tl.pointer_type(WORD))
    dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(WORD))
    s = h * tl.load(src_half + layer) + tl.load(src_idx + i).to(tl.int64) * tl.load(src_block + layer)
    d = h * tl.load(dst_half + layer) + tl.load(dst_idx + i).to(tl.int64) * tl.load(dst_block + layer)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < elems
    tl.store(dst + d + offs, tl.load(src + s + offs, mask=ok), mask=ok)


def _uniform(layers: list[torch.Tensor]) -> bool:
    """One dtype and block shape, contiguous blocks: what the kernel handles."""
    t0 = layers[0]
    return all(t.dtype == t0.dtype and t.shape[0] == t0.shape[0] and t.shape[2:] == t0.shape[2:]
               and t[0, 0].is_contiguous() and t.stride(1) == t[0, 0].numel() for t in layers)


def _launch(src: list[torch.Tensor], dst: list[torch.Tensor], src_blocks: torch.Tensor,
            dst_blocks: torch.Tensor) -> None:
    device = src[0].device
    n, halves, elems = len(src_blocks), src[0].shape[0], src[0][0, 0].numel()
    word = {torch.int8: tl.int8, torch.int16: tl.int16, torch.int32: tl.int32, torch.int64: tl.int64}[
        _INT[src[0].element_size()]]

    def table(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    block = min(triton.next_power_of_2(elems), 4096)
    _copy_blocks_kernel[(n * halves, len(src), triton.cdiv(elems, block))](
        table([t.data_ptr() for t in src]), table([t.data_ptr() for t in dst]),
        src_blocks.to(device=device, dtype=torch.int64), dst_blocks.to(device=device, dtype=torch.int64),
        table([t.stride(0) for t in src]), table([t.stride(0) for t in dst]),
        table([t.stride(1) for t in src]), table([t.stride(1) for t in dst]),
        halves, elems, WORD=word, BLOCK=block)


def _staging(like: list[torch.Tensor], n: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """[layers, halves, n, ...]: each layer's n blocks, one contiguous tensor."""
    t0 = like[0]
    return torch.empty((len(like), t0.shape[0], n, *t0.shape[2:]), dtype=t0.dtype, device=device,
                       pin_memory=pin)


def copy_blocks(src: list[torch.Tensor], dst: list[torch.Tensor], src_blocks: torch.Tensor,
                dst_blocks: torch.Tensor) -> None:
    """Same as `copy_blocks_ref`: on one device in one launch; between a device and the host through one
    staging transfer."""
    if len(src_blocks) == 0:
        return
    for idx, layers in ((src_blocks, src), (dst_blocks, dst)):  # raw addresses: never out of bounds
        if int(idx.min()) < 0 or int(idx.max()) >= min(t.shape[1] for t in layers):
            raise IndexError(f"copy_blocks: block index out of range for {layers[0].shape[1]} blocks")
    if not (_uniform(src) and _uniform(dst) and src[0].dtype == dst[0].dtype
            and src[0].shape[2:] == dst[0].shape[2:]):
        return copy_blocks_ref(src, dst, src_blocks, dst_blocks)
    if src[0].device == dst[0].device:
        return _launch(src, dst, src_blocks, dst_blocks)
    copy_through_staging(src, dst, src_blocks, dst_blocks)


def copy_through_staging(src: list[torch.Tensor], dst: list[torch.Tensor], src_blocks: torch.Tensor,
                         dst_blocks: torch.Tensor) -> None:
    """Gather on the source's device into a staging tensor, one transfer, scatter on the destination's."""
    from rivulet.kernels.cpu.ops import copy_blocks as copy_blocks_cpu

    n = len(src_blocks)
    order = torch.arange(n)
    on_src = _staging(src, n, src[0].device)
    gather = copy_blocks_cpu if src[0].device.type == "cpu" else _launch
    gather(src, list(on_src.unbind(0)), src_blocks, order)
    on_dst = _staging(dst, n, dst[0].device, pin=dst[0].device.type == "cpu" and torch.cuda.is_available())
    on_dst.copy_(on_src)  # the one transfer (blocking: the scatter reads it next)
    scatter = copy_blocks_cpu if dst[0].device.type == "cpu" else _launch
    scatter(list(on_dst.unbind(0)), dst, order, dst_blocks)
