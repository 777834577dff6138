"""Turn a list of per-sequence chunks into the flat tensors the model takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rivulet.kernels.attention import AttentionMetadata, BatchLayout, build_attention_metadata


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


def build_flat_batch(chunks: list[SeqChunk], block_size: int, device: torch.device) -> FlatBatch:
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

    def t(x: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    layout = BatchLayout(qsl, lens)
    meta = build_attention_metadata(layout, t(slots, torch.int64), t(tables, torch.int32), t(qsl, torch.int32),
                                    t(lens, torch.int32))
    return FlatBatch(t(ids, torch.int64), t(pos, torch.int64), meta, t([q - 1 for q in qsl[1:]], torch.int64), layout)
