"""Drive a ModelRunner by hand: one sequence at a time or mixed flat batches."""

from __future__ import annotations

from pathlib import Path

import torch

from rivulet.config import CacheConfig, ModelConfig
from rivulet.models.loader import resolve_model
from rivulet.worker.batch import SeqChunk
from rivulet.worker.model_runner import ModelRunner


def make_runner(model: str | Path, dtype: str = "float32", num_blocks: int = 128, block_size: int = 4,
                quantization: str | None = None, compilation_level: int = 0, kv_cache_dtype: str = "auto") -> ModelRunner:
    r = ModelRunner(ModelConfig(model=str(model), dtype=dtype, quantization=quantization,  # type: ignore[arg-type]
                                compilation_level=compilation_level),
                    CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype), resolve_model(str(model)))
    r.allocate_kv_cache(num_blocks)
    return r


def teacher_forced_logits(r: ModelRunner, ids: list[int], chunks: list[int], blocks: list[int]) -> torch.Tensor:
    """Logits of every position of `ids`: prefill in chunks of the given sizes, then one token per step."""
    out, done = [], 0
    for n in chunks:
        out.append(r.forward([SeqChunk(ids[done:done + n], done, blocks)], all_logits=True))
        done += n
    for i in range(done, len(ids)):
        out.append(r.forward([SeqChunk([ids[i]], i, blocks)]))
    return torch.cat(out)
