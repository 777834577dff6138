"""CUDA graphs for uniform steps: decode (one new token per sequence) and, with speculative decoding,
verification (1 + k tokens per sequence).

A decode step launches hundreds of small kernels whose CPU launch cost exceeds their GPU time at
small batches. We capture the model's forward once per batch-size bucket (and query length) and
replay it:

- The graph reads its inputs from static buffers (input_ids, positions, slot_mapping,
  block_tables, seq_lens, query_start_loc) sized for the largest bucket; each step copies its
  own tensors into the first rows and pads the rest of the bucket with harmless sequences: tokens 0
  at positions 0..q-1, slot -1 (the KV-cache write skips it), context length q over block 0 (read,
  never written, and the rows' outputs are dropped).
- Only steps where every sequence has exactly q new tokens, for a captured q, use a graph, and only
  up to the largest bucket and block-table width captured; anything else runs eagerly. A verify
  step qualifies when every request got its k drafts (a draft model always proposes k; prompt
  lookup may find fewer, and then the step runs eagerly).
- The kernels inside must not read host copies of the metadata nor synchronise: the Triton ops
  qualify (the attention grid depends on shapes only), the PyTorch references do not all
  (`write_kv_cache_ref` cannot skip slot -1), so graphs are used with the "triton" backend only.

Only the model forward (hidden states) is captured; logits and sampling run eagerly after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from rivulet.kernels.attention import AttentionMetadata, BatchLayout, build_attention_metadata
from rivulet.worker.batch import FlatBatch

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def verify_buckets(disable_by_batch_size: int | None) -> tuple[int, ...]:
    """Batch sizes captured for verify steps: up to 64 sequences (speculation pays at small batches), or up to
    where `disable_by_batch_size` stops it."""
    top = min(64, disable_by_batch_size) if disable_by_batch_size is not None else 64
    return tuple(b for b in DEFAULT_BUCKETS if b < top) + (top,) if top >= 1 else (1,)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the graph's output buffer [bucket, hidden_size]


class DecodeGraphs:
    """Static inputs for steps of `query_len` new tokens per sequence at batch sizes up to max(buckets),
    and one graph per bucket."""

    def __init__(self, buckets: tuple[int, ...], max_blocks_per_seq: int, device: torch.device,
                 query_len: int = 1) -> None:
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks_per_seq = max_blocks_per_seq
        self.q = q = query_len
        b = self.buckets[-1]
        self.input_ids = torch.zeros(b * q, dtype=torch.int64, device=device)
        self._pad_positions = torch.arange(q, dtype=torch.int64, device=device).repeat(b)  # 0..q-1 per sequence
        self.positions = self._pad_positions.clone()
        self.slot_mapping = torch.full((b * q,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((b,), q, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=device)  # q per sequence
        self.captured: dict[int, _Captured] = {}
        self.capture_s = 0.0

    # ---- inputs ----

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` sequences, or None."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def fits(self, meta: AttentionMetadata, layout: BatchLayout) -> bool:
        """Whether this step can replay a graph: `q` new tokens for every sequence (`layout` is the step's
        host-side shape), within the buckets and table width."""
        n = meta.num_seqs
        return (meta.slot_mapping.shape[0] == n * self.q and self.bucket_for(n) is not None
                and meta.block_tables.shape[1] <= self.max_blocks_per_seq
                and (self.q == 1 or layout.max_query_len == self.q))  # n * q tokens, none over q: all q

    def static_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of the static buffers for a batch of `bucket` sequences of `q` tokens.

        The plan describes the padded bucket's shape; the tensors hold each step's values, so kernels
        must read those."""
        q, t = self.q, bucket * self.q
        meta = build_attention_metadata(
            BatchLayout(list(range(0, t + 1, q)), [q] * bucket), self.slot_mapping[:t], self.block_tables[:bucket],
            self.query_start_loc[:bucket + 1], self.seq_lens[:bucket])
        return self.input_ids[:t], self.positions[:t], meta

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int) -> None:
        """Copy one step into the first rows of the static buffers and pad up to `bucket` sequences."""
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        t = n * self.q
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)  # columns past a sequence's length are never read
        self.pad(n, bucket)

    def pad(self, start: int, bucket: int) -> None:
        """Sequences start..bucket-1 become padding: tokens 0 at positions 0..q-1, not stored, context q in
        block 0."""
        if bucket > start:
            q = self.q
            self.input_ids[start * q:bucket * q].zero_()
            self.positions[start * q:bucket * q].copy_(self._pad_positions[:(bucket - start) * q])
            self.slot_mapping[start * q:bucket * q].fill_(-1)
            self.seq_lens[start:bucket].fill_(q)
            self.block_tables[start:bucket, 0].zero_()

    # ---- capture and replay ----

    def capture(self, forward: ModelForward, pool: tuple | None = None) -> tuple | None:
        """Capture `forward` once per bucket, largest first, all graphs sharing one memory pool (`pool`, from
        an earlier capture, or a new one); returns the pool."""
        t0 = time.perf_counter()
        for bucket in reversed(self.buckets):
            ids, pos, meta = self.static_inputs(bucket)
            self.pad(0, bucket)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernels outside the capture
                forward(ids, pos, meta)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward(ids, pos, meta)
            pool = graph.pool()
            self.captured[bucket] = _Captured(graph, hidden)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        return pool

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            layout: BatchLayout) -> torch.Tensor | None:
        """Hidden states [num_seqs * q, hidden] of a step by graph replay, or None when the step does not
        fit a captured graph (the caller then runs the model eagerly)."""
        if not self.captured or not self.fits(meta, layout):
            return None
        bucket = self.bucket_for(meta.num_seqs)
        assert bucket is not None
        self.load(input_ids, positions, meta, bucket)
        captured = self.captured[bucket]
        captured.graph.replay()
        return captured.hidden[: meta.num_seqs * self.q].clone()  # the buffer is overwritten by the next replay


class StepGraphs:
    """The graph sets of every captured query length (1: decode; 1 + k: verification), one memory pool."""

    def __init__(self, sets: list[DecodeGraphs]) -> None:
        self.sets = {g.q: g for g in sets}

    @property
    def capture_s(self) -> float:
        return sum(g.capture_s for g in self.sets.values())

    @property
    def buckets(self) -> tuple[int, ...]:
        """The decode steps' batch sizes."""
        return self.sets[1].buckets

    def capture(self, forward: ModelForward) -> None:
        pool = None
        for g in self.sets.values():
            pool = g.capture(forward, pool)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            layout: BatchLayout) -> torch.Tensor | None:
        n = meta.num_seqs
        g = self.sets.get(input_ids.shape[0] // n) if n and input_ids.shape[0] % n == 0 else None
        return None if g is None else g.run(input_ids, positions, meta, layout)


def hidden_states(graphs: DecodeGraphs | StepGraphs | None, forward: ModelForward, batch: FlatBatch) -> torch.Tensor:
    """Hidden states of a flat batch: a replay of `graphs` when one fits the step, else `forward` eagerly."""
    hidden = graphs.run(batch.input_ids, batch.positions, batch.meta, batch.layout) if graphs is not None else None
    return hidden if hidden is not None else forward(batch.input_ids, batch.positions, batch.meta)
