"""The CPU attention backend over the paged KV cache (layout in `rivulet.kernels.attention`).

Two C++ kernels read the pages in place, each one call per layer for the whole step: decode tokens
(one query token per sequence) and the sequences with more than one query token (prefill chunks,
k-token steps; `prefill_attention.cpp`, flash attention with the query rows in the vector lanes; in
bf16 on CPUs with usable AMX, `amx_attention.cpp`: both matmuls on AMX tiles, 3x faster at 1k tokens;
RIVULET_CPU_PREFILL_AMX=0 keeps the AVX-512 kernel, for comparisons).
Without the C++ build (or bf16 without AVX512-BF16) decodes are one SDPA over the gathered pages
padded to the longest context, and each prefill chunk one SDPA over its gathered context, in the
4-D layout that PyTorch's fused CPU kernel (flash attention) takes (a 3-D call falls back to the
unfused math path, about 15x slower at 1k tokens). A chunk that starts at position 0 needs no mask.
Capped scores (Gemma 2's attention soft-capping) always take these SDPA paths, with the scores
materialised (`kernels.attention.attend`): the C++ kernels do not cap.

Which sequences decode is planned once per step (`plan_attention_cpu`) as tensors in the metadata;
every call below is a dispatcher op, so a compiled model records them as they are.
"""

from __future__ import annotations

import os

import torch

from rivulet.kernels.attention import AttentionMetadata, BatchLayout, attend
from rivulet.kernels.cpu import load_cpu_ext

_PLAN_KEYS = ("cpu_decode_rows", "cpu_decode_seqs", "cpu_prefill_seqs")
_ext = load_cpu_ext()
DECODE_KERNEL = _ext is not None
# the AVX-512 decode kernel also reads a float8_e5m2 cache (`--kv-cache-dtype fp8_e5m2`) at these head dims
FP8_DECODE = DECODE_KERNEL and bool(getattr(_ext, "FP8_DECODE_KERNEL", False))
_FP8_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
PREFILL_KERNEL = _ext is not None and hasattr(_ext, "prefill_attention")  # AVX-512 code
PREFILL_KERNEL_BF16 = PREFILL_KERNEL and bool(_ext.PREFILL_ATTENTION_BF16)
if PREFILL_KERNEL and os.environ.get("RIVULET_CPU_PREFILL_AMX") == "0":
    _ext.prefill_attention_amx(False)


def plan_attention_cpu(layout: BatchLayout) -> dict[str, torch.Tensor]:
    """The flat-batch row and sequence of each decode token, and the sequences with more query tokens."""
    qsl = layout.query_start_loc
    decode = [i for i in range(layout.num_seqs) if qsl[i + 1] - qsl[i] == 1]
    prefill = [i for i in range(layout.num_seqs) if qsl[i + 1] - qsl[i] > 1]
    return {"cpu_decode_rows": torch.tensor([qsl[i] for i in decode], dtype=torch.long),
            "cpu_decode_seqs": torch.tensor(decode, dtype=torch.long),
            "cpu_prefill_seqs": torch.tensor(prefill, dtype=torch.long)}


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the paged cache: decodes in one call, prefill chunks in
    one more (or one SDPA each without the kernel; capped scores, Gemma 2, always take that path)."""
    if _PLAN_KEYS[0] not in meta.plan:  # hand-made metadata (tests): plan it now
        meta.plan.update(plan_attention_cpu(meta.layout()))
    rows, seqs, prefill = (meta.plan[k] for k in _PLAN_KEYS)
    window = sliding_window or 0
    out = torch.empty_like(query)
    # an eager step skips a kind it has no tokens of (a decode step's empty prefill call cost ~8 µs a layer); a
    # compiled graph keeps both calls, whatever the step holds
    traced = torch.compiler.is_compiling()
    if traced or rows.shape[0]:
        cache_fits = query.dtype == kv_cache.dtype or (
            kv_cache.dtype == torch.float8_e5m2 and FP8_DECODE and query.shape[-1] in _FP8_HEAD_DIMS)
        if DECODE_KERNEL and not softcap and cache_fits and query.dtype in (torch.float32, torch.bfloat16):
            torch.ops.rivulet.decode_attention.default(query, kv_cache, meta.block_tables, meta.seq_lens, rows, seqs,
                                                       out, scale, window)
        else:
            torch.ops.rivulet.cpu_sdpa_decode(query, kv_cache, meta.block_tables, meta.seq_lens, rows, seqs, out,
                                              scale, window, softcap)
    if traced or prefill.shape[0]:
        widen = kv_cache.dtype == torch.float8_e5m2 and not traced
        if widen and not softcap and prefill_kernel(query, kv_cache, widened=True):
            # an fp8 cache: the blocks the chunks read, widened, to the same kernel
            cache, tables = _widened_blocks(kv_cache, meta.block_tables, prefill, meta.seq_lens, query.dtype)
            torch.ops.rivulet.prefill_attention.default(query, cache, tables, meta.query_start_loc, meta.seq_lens,
                                                        prefill, out, scale, window)
        elif not softcap and prefill_kernel(query, kv_cache):
            torch.ops.rivulet.prefill_attention.default(query, kv_cache, meta.block_tables, meta.query_start_loc,
                                                        meta.seq_lens, prefill, out, scale, window)
        else:
            torch.ops.rivulet.cpu_sdpa_prefill(query, kv_cache, meta.block_tables, meta.query_start_loc,
                                               meta.seq_lens, prefill, out, scale, window, softcap)
    return out


@torch.library.custom_op("rivulet::cpu_sdpa_decode", mutates_args=("out",))
def _sdpa_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 rows: torch.Tensor, seqs: torch.Tensor, out: torch.Tensor, scale: float, window: int,
                 softcap: float) -> None:
    """Decode tokens without the kernel: one SDPA over their gathered pages, padded to the longest."""
    s = rows.shape[0]
    if s == 0:
        return
    _, num_blocks, block_size, hk, d = kv_cache.shape
    lens = seq_lens[seqs].long()[:, None]
    n = -(-int(lens.max()) // block_size)
    k_pos = torch.arange(n * block_size)[None, :]
    mask = k_pos < lens
    if window:
        mask &= k_pos > lens - 1 - window
    block_ids = block_tables[seqs, :n].long().flatten()
    k = torch.index_select(kv_cache[0].view(num_blocks, -1), 0, block_ids).view(s, -1, hk, d).transpose(1, 2)
    v = torch.index_select(kv_cache[1].view(num_blocks, -1), 0, block_ids).view(s, -1, hk, d).transpose(1, 2)
    o = attend(query[rows][:, :, None, :], k.to(query.dtype), v.to(query.dtype), mask[:, None, None, :], scale,
               softcap)
    out[rows] = o[:, :, 0, :]


@torch.library.custom_op("rivulet::cpu_sdpa_prefill", mutates_args=("out",))
def _sdpa_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, seqs: torch.Tensor, out: torch.Tensor,
                  scale: float, window: int, softcap: float) -> None:
    """Each prefill chunk without the kernel: one fused SDPA over its gathered context."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in seqs.tolist():
        out[qsl[i]:qsl[i + 1]] = prefill_attention(query[qsl[i]:qsl[i + 1]], kv_cache, block_tables[i], lens[i],
                                                   scale, window or None, softcap)


@_sdpa_decode.register_fake
def _(query, kv_cache, block_tables, seq_lens, rows, seqs, out, scale, window, softcap) -> None:
    return None


@_sdpa_prefill.register_fake
def _(query, kv_cache, block_tables, query_start_loc, seq_lens, seqs, out, scale, window, softcap) -> None:
    return None


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                      scale: float, sliding_window: int | None, softcap: float = 0.0) -> torch.Tensor:
    """One sequence's query tokens [q_len, Hq, D] over its gathered context, by the fused SDPA kernel."""
    _, _, block_size, hk, d = kv_cache.shape
    q_len = query.shape[0]
    blocks = block_table[: -(-seq_len // block_size)]
    k = kv_cache[0, blocks].reshape(-1, hk, d)[:seq_len].transpose(0, 1)[None]
    v = kv_cache[1, blocks].reshape(-1, hk, d)[:seq_len].transpose(0, 1)[None]
    q = query.transpose(0, 1)[None]
    mask = None
    if sliding_window is not None or q_len != seq_len:  # causal from a later start, or a window
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
    o = attend(q, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap, is_causal=mask is None)
    return o[0].transpose(0, 1)


def _widened_blocks(kv_cache: torch.Tensor, block_tables: torch.Tensor, seqs: torch.Tensor, seq_lens: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks that sequences `seqs` read, in `dtype`, as a cache of their own, and the block tables
    renumbered into it (an fp8 cache's prefill chunks; the rest of the cache is not touched)."""
    bs = kv_cache.shape[2]
    counts = (seq_lens[seqs].long() + bs - 1) // bs
    cols = torch.arange(block_tables.shape[1])
    used = block_tables[seqs].long()[cols[None, :] < counts[:, None]]
    blocks = torch.unique(used)
    remap = torch.zeros(kv_cache.shape[1], dtype=block_tables.dtype)
    remap[blocks] = torch.arange(blocks.numel(), dtype=block_tables.dtype)
    return kv_cache[:, blocks].to(dtype), remap[block_tables.long().clamp(0, kv_cache.shape[1] - 1)]


def prefill_kernel(query: torch.Tensor, kv_cache: torch.Tensor, widened: bool = False) -> bool:
    """Whether the C++ prefill kernel takes this layer: float32, or bf16 where AVX512-BF16 is; head groups
    of at most 32 query heads; query rows with the head dim contiguous. `widened`: the cache's blocks are
    handed over in the query's dtype (`_widened_blocks`)."""
    if not PREFILL_KERNEL or (query.dtype != kv_cache.dtype and not widened):
        return False
    if not (query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and PREFILL_KERNEL_BF16)):
        return False
    hq, d, hk = query.shape[1], query.shape[2], kv_cache.shape[3]
    return hq % hk == 0 and hq // hk <= 32 and query.stride(2) == 1 and (query.dtype == torch.float32 or d % 2 == 0)
