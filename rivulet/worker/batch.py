"""The flat batch the model takes, moved to the device from host arrays; and a hand-made one from a list of
per-sequence chunks (tests, probes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from rivulet.kernels.attention import AttentionMetadata, BatchLayout, build_attention_metadata
from rivulet.worker.staging import Staging

if TYPE_CHECKING:
    from rivulet.worker.cuda_graph import DecodeGraphs, StepGraphs


@dataclass
class SeqChunk:
    """One sequence's share of a step: `token_ids` follow `num_computed` cached tokens."""

    token_ids: list[int]
    num_computed: int
    block_table: list[int]


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_seqs]: each sequence's last token in the flat batch
    layout: BatchLayout  # the host-side shape `meta`'s plan was built from
    graph: tuple[DecodeGraphs, int] | None = None  # staged into these graphs' inputs at this bucket: a replay


class StagedInputs(NamedTuple):
    """A step's device tensors, in the order `to_device` takes their host arrays."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


def to_device(input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, logits_indices: np.ndarray,
              block_tables: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray, staging: Staging,
              graphs: DecodeGraphs | StepGraphs | None = None) -> FlatBatch:
    """The flat batch of these host arrays: staged into a CUDA graph's static inputs when `graphs` has one
    that fits the step (the model then replays it), else moved by `staging` (two copies: int64, int32)."""
    layout = BatchLayout(query_start_loc.tolist(), seq_lens.tolist())
    fit = graphs.fit(len(seq_lens), len(input_ids), block_tables.shape[1], layout.max_query_len) \
        if graphs is not None else None
    if fit is not None:
        g, bucket = fit
        t = g.stage(input_ids, positions, slots, logits_indices, seq_lens, block_tables, bucket, staging)
    else:
        t = StagedInputs(*staging.move([input_ids, positions, slots, logits_indices], torch.int64),
                         *staging.move([block_tables, query_start_loc, seq_lens], torch.int32))
    meta = build_attention_metadata(layout, t.slot_mapping, t.block_tables, t.query_start_loc, t.seq_lens)
    return FlatBatch(t.input_ids, t.positions, meta, t.logits_indices, layout, fit)


def build_flat_batch(chunks: list[SeqChunk], block_size: int, device: torch.device, staging: Staging | None = None,
                     graphs: DecodeGraphs | StepGraphs | None = None) -> FlatBatch:
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    lens: list[int] = []
    for c in chunks:
        n = len(c.token_ids)
        end = c.num_computed + n
        if len(c.block_table) * block_size < end:
            raise ValueError(f"block table of {len(c.block_table)} blocks cannot hold {end} tokens")
        ids += c.token_ids
        pos += range(c.num_computed, end)
        slots += [c.block_table[p // block_size] * block_size + p % block_size for p in range(c.num_computed, end)]
        qsl.append(qsl[-1] + n)
        lens.append(end)
    width = max(len(c.block_table) for c in chunks)
    tables = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]

    def a(x: list, dtype: type = np.int64) -> np.ndarray:
        return np.array(x, dtype=dtype)

    table = a(tables, np.int32).reshape(len(chunks), width)
    return to_device(a(ids), a(pos), a(slots), a([q - 1 for q in qsl[1:]]), table, a(qsl), a(lens),
                     staging or Staging(device), graphs)
