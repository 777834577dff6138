"""Random draws on GPUs: the Gumbel race of `rivulet.kernels.sampling` (same hash, same noise up to `log`'s last
bits). One program per (row, block of 1024 tokens) writes its block's best score and first token holding it;
the row's draw is the token of its best block (the first such block on ties: the first index, as argmax)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _fmix32(h):
    # murmur3's 32-bit finalizer on int64 lanes holding uint32 values (products wrap, then are masked)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _race_kernel(logits_ptr, temp_ptr, keys_ptr, best_ptr, arg_ptr, stride_l, vocab, num_blocks,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    tok = blk * BLOCK + tl.arange(0, BLOCK)
    ok = tok < vocab
    x = tl.load(logits_ptr + row * stride_l + tok, mask=ok, other=float("-inf")).to(tl.float32)
    t = tl.load(temp_ptr + row)
    key = tl.load(keys_ptr + row)
    lo = key & 0xFFFFFFFF
    hi = (key >> 32) & 0xFFFFFFFF
    h = _fmix32(((tok.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF) ^ lo)
    h = _fmix32(h ^ hi)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
    g = -tl.log(-tl.log(u))
    greedy = t == 0.0
    s = tl.where(greedy, x, x / tl.where(greedy, 1.0, t) + g)
    s = tl.where(ok, s, float("-inf"))
    best = tl.max(s, axis=0)
    first = tl.min(tl.where(s == best, tok, vocab), axis=0)
    tl.store(best_ptr + row * num_blocks + blk, best)
    tl.store(arg_ptr + row * num_blocks + blk, tl.minimum(first, vocab - 1).to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`sample_rows_ref` for float [rows, vocab] logits with contiguous rows."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[1] == 0:
        from rivulet.kernels.sampling import sample_rows_ref

        return sample_rows_ref(logits, temperature, keys)
    rows, vocab = logits.shape
    num_blocks = triton.cdiv(vocab, _BLOCK)
    best = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    arg = torch.empty(rows, num_blocks, dtype=torch.int64, device=logits.device)
    if rows:
        temp = temperature.to(logits.device, torch.float32).contiguous()
        k = keys.to(logits.device, torch.int64).contiguous()
        _race_kernel[(rows, num_blocks)](logits, temp, k, best, arg, logits.stride(0), vocab, num_blocks,
                                         BLOCK=_BLOCK)
    return arg.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)
