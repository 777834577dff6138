"""CUDA graphs for decode-only steps.

A decode step launches hundreds of small kernels whose CPU launch cost exceeds their GPU time at
small batches. We capture the model's forward once per batch-size bucket and replay it:

- The graph reads its inputs from static buffers (input_ids, positions, slot_mapping,
  block_tables, seq_lens, query_start_loc) sized for the largest bucket; each step copies its
  own tensors into the first rows and pads the rest of the bucket with harmless rows: token 0
  at position 0, slot -1 (the KV-cache write skips it), context length 1 over block 0 (read, never
  written, and the row's output is dropped).
- Only steps where every sequence has exactly one new token use a graph (decode-only), and only
  up to the largest bucket and block-table width captured; anything else runs eagerly.
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

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the graph's output buffer [bucket, hidden_size]


class DecodeGraphs:
    """Static decode inputs for batch sizes up to max(buckets), and one graph per bucket."""

    def __init__(self, buckets: tuple[int, ...], max_blocks_per_seq: int, device: torch.device) -> None:
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks_per_seq = max_blocks_per_seq
        b = self.buckets[-1]
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)  # one token per sequence
        self.captured: dict[int, _Captured] = {}
        self.capture_s = 0.0

    # ---- inputs ----

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` sequences, or None."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether this step can replay a graph: decode-only, within the buckets and table width."""
        return (meta.slot_mapping.shape[0] == meta.num_seqs and self.bucket_for(meta.num_seqs) is not None
                and meta.block_tables.shape[1] <= self.max_blocks_per_seq)

    def static_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of the static buffers for a batch of `bucket` decode tokens.

        The plan describes the padded bucket's shape (one token per sequence); the tensors hold each
        step's values, so kernels must read those."""
        meta = build_attention_metadata(
            BatchLayout(list(range(bucket + 1)), [1] * bucket), self.slot_mapping[:bucket], self.block_tables[:bucket],
            self.query_start_loc[:bucket + 1], self.seq_lens[:bucket])
        return self.input_ids[:bucket], self.positions[:bucket], meta

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int) -> None:
        """Copy one decode step into the first rows of the static buffers and pad up to `bucket`."""
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)  # columns past a sequence's length are never read
        self.pad(n, bucket)

    def pad(self, start: int, bucket: int) -> None:
        """Rows start..bucket-1 become padding: token 0 at position 0, not stored, context 1 in block 0."""
        if bucket > start:
            self.input_ids[start:bucket].zero_()
            self.positions[start:bucket].zero_()
            self.slot_mapping[start:bucket].fill_(-1)
            self.seq_lens[start:bucket].fill_(1)
            self.block_tables[start:bucket, 0].zero_()

    # ---- capture and replay ----

    def capture(self, forward: ModelForward) -> None:
        """Capture `forward` once per bucket, largest first, all graphs sharing one memory pool."""
        t0 = time.perf_counter()
        pool = None
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

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [num_seqs, hidden] of a decode step by graph replay, or None when the
        step does not fit a captured graph (the caller then runs the model eagerly)."""
        if not self.captured or not self.fits(meta):
            return None
        bucket = self.bucket_for(meta.num_seqs)
        assert bucket is not None
        self.load(input_ids, positions, meta, bucket)
        captured = self.captured[bucket]
        captured.graph.replay()
        return captured.hidden[: meta.num_seqs].clone()  # the buffer is overwritten by the next replay

