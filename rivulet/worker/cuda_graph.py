"""CUDA graphs for uniform steps: decode (one new token per sequence) and, with speculative decoding,
verification (1 + k tokens per sequence).

A decode step launches hundreds of small kernels whose CPU launch cost exceeds their GPU time at
small batches. We capture the model's forward once per batch-size bucket (and query length) and
replay it:

- The graph reads its inputs from static buffers (input_ids, positions, slot_mapping,
  block_tables, seq_lens, query_start_loc) sized for the largest bucket. They are the step's input
  buffers: a step that fits is built on the host straight into their pinned mirrors (`stage`, called
  by the flat-batch builder when it is given the graphs) and moved by non-blocking copies, its own
  values in the first rows and the rest of the bucket harmless sequences: tokens 0 at positions
  0..q-1, slot -1 (the KV-cache write skips it), context length q over whatever block their table
  rows hold (read, never written, and the rows' outputs are dropped).
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

import numpy as np
import torch

from rivulet.kernels.attention import AttentionMetadata, BatchLayout, build_attention_metadata
from rivulet.worker.batch import FlatBatch, StagedInputs
from rivulet.worker.staging import Mirror, Staging

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

_EMPTY_STEP = (np.zeros(0, np.int64),) * 5 + (np.zeros((0, 1), np.int32),)  # no sequence: all padding

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
    and one graph per bucket.

    Token ids, positions, slots and logits indices are the device half of one int64 `Mirror`, sequence
    lengths of one int32 `Mirror`: a step that fits is written (padded) into their pinned halves and moved
    by two non-blocking copies. Block tables are a device tensor [max bucket, max blocks] into which each
    step's own [n, width] table (moved compact by the runner's `Staging`) is copied on the device: one more
    copy, instead of sending the whole width of every bucket row each step. Each field starts 16-byte
    aligned (Triton specializes kernels on aligned pointers)."""

    def __init__(self, buckets: tuple[int, ...], max_blocks_per_seq: int, device: torch.device,
                 query_len: int = 1) -> None:
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks_per_seq = w = max_blocks_per_seq
        self.q = q = query_len
        self.max_seqs = b = self.buckets[-1]
        self.max_tokens = t = b * q
        self._row = row = -(-t // 2) * 2  # int64 fields 16-byte aligned
        self._pad_positions = np.tile(np.arange(q, dtype=np.int64), b)  # 0..q-1 per sequence
        self._i64 = Mirror(4 * row, torch.int64, device)
        self._lens = Mirror(b, torch.int32, device)
        self.input_ids, self.positions, self.slot_mapping, self.logits_indices = (
            f[:t] for f in self._i64.device_buf.view(4, row).unbind(0))
        self.seq_lens = self._lens.device_buf
        with torch.inference_mode(False):
            self.block_tables = torch.zeros(b, w, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=device)  # q per sequence
        self.stage(*_EMPTY_STEP, bucket=b)  # every sequence padding
        self.captured: dict[int, _Captured] = {}
        self.capture_s = 0.0

    # ---- inputs ----

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` sequences, or None."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def fit(self, num_seqs: int, num_tokens: int, width: int, max_query_len: int) -> tuple[DecodeGraphs, int] | None:
        """(self, bucket) when a step of this shape can replay a graph: `q` new tokens for every sequence,
        within the buckets and the block-table width; else None."""
        if num_tokens != num_seqs * self.q or width > self.max_blocks_per_seq or \
                (self.q > 1 and max_query_len != self.q):  # n * q tokens and none over q: all q
            return None
        bucket = self.bucket_for(num_seqs)
        return None if bucket is None else (self, bucket)

    def static_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of the static buffers for a batch of `bucket` sequences of `q` tokens.

        The plan describes the padded bucket's shape; the tensors hold each step's values, so kernels
        must read those."""
        q, t = self.q, bucket * self.q
        meta = build_attention_metadata(
            BatchLayout(list(range(0, t + 1, q)), [q] * bucket), self.slot_mapping[:t], self.block_tables[:bucket],
            self.query_start_loc[:bucket + 1], self.seq_lens[:bucket])
        return self.input_ids[:t], self.positions[:t], meta

    def stage(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, logits_indices: np.ndarray,
              seq_lens: np.ndarray, block_tables: np.ndarray, bucket: int, staging: Staging | None = None
              ) -> StagedInputs:
        """Write a step of n sequences (host arrays) into the static inputs, sequences n..bucket-1 padding
        (tokens 0 at positions 0..q-1, not stored, context q in whatever block their table rows hold: a block
        id of an earlier step, or 0; read, never written), and start their copies to the device (the block
        table through `staging`). Views of the step's own part of the static inputs."""
        n, q, row = len(seq_lens), self.q, self._row
        t, end = n * q, bucket * q
        h = self._i64.writable().reshape(4, row)
        h[0, :t], h[0, t:end] = input_ids, 0
        h[1, :t], h[1, t:end] = positions, self._pad_positions[: end - t]
        h[2, :t], h[2, t:end] = slots, -1
        h[3, :len(logits_indices)] = logits_indices
        self._i64.push(4 * row)
        lens = self._lens.writable()
        lens[:n], lens[n:bucket] = seq_lens, q
        self._lens.push(bucket)
        width = block_tables.shape[1]
        if n:
            assert staging is not None, "a step's block table moves through the runner's staging"
            (compact,) = staging.move([block_tables], torch.int32)
            self.block_tables[:n, :width].copy_(compact)  # columns past a sequence's length are never read
        return StagedInputs(self.input_ids[:t], self.positions[:t], self.slot_mapping[:t],
                            self.logits_indices[:len(logits_indices)], self.block_tables[:n, :width],
                            self.query_start_loc[:n + 1], self.seq_lens[:n])

    # ---- capture and replay ----

    def capture(self, forward: ModelForward, pool: tuple | None = None) -> tuple | None:
        """Capture `forward` once per bucket, largest first, all graphs sharing one memory pool (`pool`, from
        an earlier capture, or a new one); returns the pool."""
        t0 = time.perf_counter()
        for bucket in reversed(self.buckets):
            ids, pos, meta = self.static_inputs(bucket)
            self.stage(*_EMPTY_STEP, bucket=bucket)
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

    def replay(self, bucket: int, num_tokens: int) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step staged last, by replaying the graph of `bucket`."""
        captured = self.captured[bucket]
        captured.graph.replay()
        return captured.hidden[:num_tokens].clone()  # the buffer is overwritten by the next replay


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

    def fit(self, num_seqs: int, num_tokens: int, width: int, max_query_len: int) -> tuple[DecodeGraphs, int] | None:
        """The graph set of the step's query length and its bucket, when the step fits one."""
        g = self.sets.get(num_tokens // num_seqs) if num_seqs and num_tokens % num_seqs == 0 else None
        return None if g is None else g.fit(num_seqs, num_tokens, width, max_query_len)


def hidden_states(forward: ModelForward, batch: FlatBatch) -> torch.Tensor:
    """Hidden states of a flat batch: a replay when it was staged into a graph's inputs, else `forward` eagerly."""
    if batch.graph is not None:
        graphs, bucket = batch.graph
        return graphs.replay(bucket, batch.input_ids.shape[0])
    return forward(batch.input_ids, batch.positions, batch.meta)
