"""Token bitmask (structured output): logits[r, t] = -inf where bit t % 32 of word t // 32 of row r's int32
bitmask is 0. In place, one program per (row, block of tokens)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, mask_ptr, stride_l, stride_m, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = tok < vocab
    words = tl.load(mask_ptr + row * stride_m + tok // 32, mask=ok, other=-1)
    allowed = ((words >> (tok % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + tok, tl.full([BLOCK], float("-inf"), tl.float32), mask=ok & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Same as `apply_token_bitmask_ref` for float32 logits [rows, vocab], in place; returns `logits`."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        from rivulet.kernels.bitmask import apply_token_bitmask_ref

        return apply_token_bitmask_ref(logits, bitmask)
    mask = bitmask.to(device=logits.device, dtype=torch.int32).contiguous()
    rows, vocab = logits.shape
    block = 1024
    if rows:
        _apply_token_bitmask_kernel[(rows, triton.cdiv(vocab, block))](logits, mask, logits.stride(0), mask.stride(0),
                                                                       vocab, BLOCK=block)
    return logits
