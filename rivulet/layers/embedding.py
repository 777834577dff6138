"""Token embedding and LM head with the vocabulary split over tensor-parallel ranks."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rivulet.distributed import (get_parallel_state, tensor_parallel_all_gather, tensor_parallel_all_reduce,
                                 tensor_parallel_reduce_scatter)
from rivulet.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, end) of the (padded) vocabulary; lookups outside the range
    give zeros and the all-reduce assembles the full embedding."""

    gathered_params: tuple[str, ...] = ("weight",)  # read by rows only (Platform.place_module)

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.tp_rank, self.tp_size = self.parallel.tp_rank, self.parallel.tp_size
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        n = self.vocab_end - self.vocab_start
        param.data.zero_()
        default_weight_loader(param.data[:n], loaded.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        y = F.embedding(local, self.weight).masked_fill(outside[:, None], 0)
        if self.parallel.sp:  # sequence parallel: the layers start from this rank's token shard
            return tensor_parallel_reduce_scatter(y, self.parallel)
        return tensor_parallel_all_reduce(y, self.parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits; may share its weight with the embedding."""

    quantizable = True  # layers.quantization may give it a compact weight copy

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.quant: Callable[..., torch.Tensor] | None = None  # set by layers.quantization after loading (compact or packed weight)

    @property
    def gathered_params(self) -> tuple[str, ...]:  # type: ignore[override]
        """The plain weight is read whole by `compute_logits` unless a compact or packed copy is."""
        return () if self.quant is None else ("weight",)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Full-vocabulary logits [T, vocab] in float32, or in the matmul's dtype with `float32=False` (the
        sampler widens them only where it computes more than an argmax)."""
        logits = F.linear(hidden, self.weight) if self.quant is None else self.quant(hidden, self.weight, None)
        logits = tensor_parallel_all_gather(logits, self.parallel)[:, : self.num_embeddings]
        return logits.float() if float32 else logits
