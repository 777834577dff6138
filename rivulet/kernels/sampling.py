"""Random draws for the sampler: a Gumbel race over counter-based noise (the reference; the CPU backend's C++
kernel in `cpu/sampling.cpp` computes the same, with its own `log`).

Row r's token is the index of the largest ``logits[r, v] / temperature[r] + g(keys[r], v)``, where ``g`` is
Gumbel(0, 1) noise hashed from the row's 64-bit key and the token id: ``u`` = 23 bits of two rounds of
murmur3's 32-bit finalizer over ``(v * 0x9E3779B9) ^ key.lo`` and then ``^ key.hi``, ``u = (m + 1/2) / 2^23``,
``g = -log(-log(u))``. The argmax of logits plus Gumbel noise is a draw from ``softmax(logits / t)``; because
each token has its own noise, logits that differ in their last bits (another batch shape, a recompute after
preemption) change the draw only where two tokens' noisy scores are that close. A temperature of 0 gives
the row's argmax.

Also here: the reference of the top-k / top-p mask (`top_k_top_p_ref`; the CPU backend's kernel in
`cpu/top_k_top_p.cpp` finds the same thresholds by a radix select instead of a sort).
"""

from __future__ import annotations

import torch

def _i32(c: int) -> int:
    """A uint32 constant as the int32 of the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int32 tensors holding uint32 bits (products wrap; shifts made logical)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _i32(0x85EBCA6B)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _i32(0xC2B2AE35)
    return h ^ ((h >> 16) & 0xFFFF)


def gumbel_noise_ref(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [rows, vocab]: the noise of each row's key (int64 [rows]) for tokens 0..vocab-1."""
    keys = keys.to(torch.int64).unsqueeze(1)

    def half(k: torch.Tensor) -> torch.Tensor:  # 32 bits as int32
        return torch.where(k >= 1 << 31, k - (1 << 32), k).to(torch.int32)

    lo, hi = half(keys & 0xFFFFFFFF), half((keys >> 32) & 0xFFFFFFFF)
    v = torch.arange(vocab_size, dtype=torch.int32, device=keys.device)
    h = _fmix32(_fmix32((v * _i32(0x9E3779B9)) ^ lo) ^ hi)
    u = (((h >> 9) & 0x7FFFFF).float() + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def sample_rows_ref(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's draw from ``softmax(logits / temperature)`` keyed by its key, or its argmax
    where the temperature is 0. ``logits`` float [rows, vocab], ``temperature`` float32 [rows], ``keys``
    int64 [rows]."""
    x = logits.float()
    t = temperature.to(x.device, torch.float32).unsqueeze(1)
    greedy = t == 0
    noise = gumbel_noise_ref(keys.to(x.device), x.shape[1])
    scores = torch.where(greedy, x, x / torch.where(greedy, 1.0, t) + noise)
    return scores.argmax(dim=-1)


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: each row's first index of its maximum."""
    return logits.argmax(dim=-1)


def top_k_top_p_ref(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """float32 [rows, vocab] with -inf where row r's top-k (int64, ``1 <= k <= vocab``) and then top-p (float32,
    ``0 < p <= 1``) mask a token. top-k keeps logits ``>=`` the k-th largest; top-p keeps the smallest prefix of
    the rest, in descending order, whose probability (renormalised after top-k) summed in float64 reaches ``p``
    (at least one token); both keep every token tied with their last one. A new tensor."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(1, vocab_size) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.double().softmax(dim=-1)
        cumulative = sorted_probs.cumsum(dim=-1)
        # tokens needed to reach top_p: those before the first cumulative sum >= top_p, and that one
        num_keep = (cumulative < top_p.double().unsqueeze(1)).sum(dim=-1) + 1
        num_keep = torch.where(top_p >= 1.0, vocab_size, num_keep.clamp(max=vocab_size))
        threshold = sorted_logits.gather(1, (num_keep - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)
