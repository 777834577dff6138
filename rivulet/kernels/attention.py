"""Attention over a paged KV cache, for one flat batch that mixes prefill chunks and decodes.

KV cache layout of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys then
values). A token's slot is ``block_id * block_size + offset``. Sequence ``i`` owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` of the batch; its context (cached tokens plus the new
ones) has ``seq_lens[i]`` tokens whose blocks are ``block_tables[i]``. The new tokens are the last
ones of the context, so query token ``j`` of sequence ``i`` sits at position
``seq_lens[i] - q_len + j`` and attends causally up to and including itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from rivulet.kernels.library import graph_op
from rivulet.plugins import load_kernel_plugins


@dataclass(frozen=True)
class BatchLayout:
    """The host-side shape of a flat batch: each sequence's first query token and context length.

    Backends build their per-step plans from it; the model never reads it (a compiled graph would
    specialize on every value)."""

    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc
        return max((b - a for a, b in zip(q, q[1:])), default=0)


@dataclass
class AttentionMetadata:
    """Per-step description of the flat batch, shared by every attention layer: tensors only, so that
    a compiled model takes it as graph inputs. `plan` holds what the step's attention backend derived
    from the batch layout once for every layer (e.g. which sequences decode), also as tensors."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    plan: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def layout(self) -> BatchLayout:
        """The host layout read back from the tensors (a device sync on GPUs: for tests and fallbacks)."""
        return BatchLayout(self.query_start_loc.tolist(), self.seq_lens.tolist())


def write_kv_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [T, Hk, D] into their slots of the paged cache."""
    _, num_blocks, block_size, hk, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hk, d)
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    if kv_cache.dtype.itemsize == 1:  # fp8 (rounded above): copied as bytes, which index_copy_ takes
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


@graph_op("rivulet_ref", "write_kv_cache", lambda key, value, kv_cache, slot_mapping: None, mutates_args=("kv_cache",))
def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`write_kv_cache_ref` as one op in a compiled graph (where no kernel backend has its own): the graph writes
    the cache in place (traced, the write would be functionalized into a copy of the whole cache per step)."""
    write_kv_cache_ref(key, value, kv_cache, slot_mapping)


@graph_op("rivulet_ref", "write_latent_cache", lambda entry, cache, slot_mapping: None, mutates_args=("cache",))
def write_latent_cache(entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store multi-head latent attention's entries [T, D] into their slots of its cache [1, num_blocks,
    block_size, 1, D]; one op in a compiled graph, which writes the cache in place (traced, the write would
    be functionalized into a copy of the whole cache per step)."""
    flat = cache.view(-1, cache.shape[-1])
    flat.index_copy_(0, slot_mapping, entry.to(cache.dtype))


def rotary_write_kv_cache_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, value: torch.Tensor, cos_sin_cache: torch.Tensor,
    interleaved: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`apply_rotary` of q and k, then `write_kv_cache` of the rotated keys and `value`; returns the
    rotated queries (what the RoPE + KV-write fusion pass puts in place of the two ops)."""
    from rivulet.kernels.rotary import apply_rotary_ref

    q, k = apply_rotary_ref(positions, q, k, cos_sin_cache, interleaved)
    write_kv_cache_ref(k.view(value.shape), value, kv_cache, slot_mapping)
    return q


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the cached context of each sequence (GQA aware).
    `softcap` > 0 caps the scaled scores s to softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
    return torch.ops.rivulet.paged_attention_ref(query, kv_cache, meta.block_tables, meta.query_start_loc,
                                                 meta.seq_lens, scale, sliding_window or 0, softcap)


@torch.library.custom_op("rivulet::paged_attention_ref", mutates_args=())
def _paged_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int, softcap: float) -> torch.Tensor:
    out = torch.empty_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in range(len(lens)):
        out[qsl[i]:qsl[i + 1]] = sequence_attention(query[qsl[i]:qsl[i + 1]], kv_cache, block_tables[i], lens[i],
                                                    scale, window or None, softcap)
    return out


@_paged_attention_ref.register_fake
def _(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, window, softcap):
    return torch.empty_like(query)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float = 0.0, is_causal: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale [capped], masked) v over [..., H, L, D] tensors (GQA: k, v with fewer heads).
    Without a cap this is PyTorch's fused SDPA; with one, the scores are materialised (float32 softmax)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = (q @ k.transpose(-1, -2)).float() * scale
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).to(v.dtype) @ v


@graph_op("rivulet_ref", "varlen_attention", lambda q, k, v, query_start_loc, scale, max_waste=1.25: torch.empty_like(q))
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                     scale: float, max_waste: float = 1.25) -> torch.Tensor:
    """Bidirectional attention of an encoder: each sequence of the flat batch attends to all of its own
    tokens and no other's, nothing cached. q [T, H, D], k and v [T, Hk, D] -> [T, H, D]. One op in a
    compiled graph (its grouping reads the sequence lengths on the host).

    Sequences of similar length are padded to the longest of their group and run as one fused SDPA with a
    key mask; a group closes when padding would make its n * L^2 work more than `max_waste` times the
    sum of its sequences' L^2 (sorted by length, so a step of short and long sequences pads little)."""
    qsl = query_start_loc.tolist()
    lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    out = torch.empty_like(q)
    order = sorted(range(len(lens)), key=lens.__getitem__)
    group: list[int] = []
    useful = 0
    for i in order + [-1]:
        n = lens[i] if i >= 0 else 0
        if group and (i < 0 or (len(group) + 1) * n * n > max_waste * (useful + n * n)):
            _padded_attention(q, k, v, [qsl[j] for j in group], [lens[j] for j in group], scale, out)
            group, useful = [], 0
        group.append(i)
        useful += n * n
    return out


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], lens: list[int],
                      scale: float, out: torch.Tensor) -> None:
    """One SDPA over sequences (first token, length) padded to the longest; results written into `out`."""
    dev = q.device
    width = max(lens)
    cols = torch.arange(width, device=dev)
    valid = cols[None, :] < torch.tensor(lens, device=dev)[:, None]  # [B, L]
    idx = torch.where(valid, torch.tensor(starts, device=dev)[:, None] + cols[None, :], 0)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
        return x[idx].transpose(1, 2)

    o = attend(padded(q), padded(k), padded(v), valid[:, None, None, :], scale)
    out[idx[valid]] = o.transpose(1, 2)[valid]


def sequence_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                       scale: float, sliding_window: int | None, softcap: float = 0.0) -> torch.Tensor:
    """One sequence's query tokens [q_len, Hq, D] (the last of its `seq_len`) over its gathered context."""
    _, _, block_size, hk, d = kv_cache.shape
    q_len = query.shape[0]
    blocks = block_table[: -(-seq_len // block_size)]
    k = kv_cache[0, blocks].reshape(-1, hk, d)[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, hk, d)[:seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    o = attend(query.transpose(0, 1), k.transpose(0, 1).to(query.dtype), v.transpose(0, 1).to(query.dtype), mask,
               scale, softcap)
    return o.transpose(0, 1)


# (query, kv_cache, metadata, scale, sliding_window, softcap) -> output
AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None", float], torch.Tensor]

ATTENTION_BACKENDS: dict[str, AttentionFn] = {"torch": paged_attention_ref}

# backends imported on first use, so that importing Rivulet never requires Triton or a C++ build
_LAZY_BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("rivulet.kernels.cpu.attention", "paged_attention_cpu"),
    "triton": ("rivulet.kernels.triton.attention", "paged_attention"),
}

# a backend's planner: the batch layout -> the tensors its forward reads in every layer of the step
AttentionPlanner = Callable[[BatchLayout], "dict[str, torch.Tensor]"]
_PLANNERS: dict[str, tuple[str, str]] = {"cpu": ("rivulet.kernels.cpu.attention", "plan_attention_cpu")}


def plan_attention(name: str, layout: BatchLayout) -> dict[str, torch.Tensor]:
    """Backend `name`'s plan of a step (empty for backends that need none)."""
    if name not in _PLANNERS:
        return {}
    module, fn = _PLANNERS[name]
    return getattr(importlib.import_module(module), fn)(layout)


def build_attention_metadata(layout: BatchLayout, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             backend: str | None = None) -> AttentionMetadata:
    """A step's metadata with the plan of `backend` (default: the current platform's) built once."""
    if backend is None:
        from rivulet.platforms import current_platform

        backend = current_platform().attention_backend()
    return AttentionMetadata(slot_mapping, block_tables, query_start_loc, seq_lens, plan_attention(backend, layout))


def register_attention_backend(name: str, fn: AttentionFn) -> None:
    """Add (or replace) attention backend `name` (a platform's `attention_backend()` names it)."""
    ATTENTION_BACKENDS[name] = fn


def get_attention_backend(name: str) -> AttentionFn:
    load_kernel_plugins()  # out-of-tree backends register theirs first (once)
    if name not in ATTENTION_BACKENDS and name in _LAZY_BACKENDS:
        module, fn = _LAZY_BACKENDS[name]
        ATTENTION_BACKENDS[name] = getattr(importlib.import_module(module), fn)
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        known = sorted(set(ATTENTION_BACKENDS) | set(_LAZY_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: {known}") from None
