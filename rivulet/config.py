"""Typed configuration, built once and passed down explicitly.

This module is pure Python (no torch import) so that ``rivulet.core`` can use it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Literal


class RivuletError(ValueError):
    """A user-facing error: bad input, missing files, unsupported model.

    The CLI prints its message on one line; the server maps it to HTTP 400.
    """


DType = Literal["auto", "float32", "bfloat16", "float16"]
LoadFormat = Literal["auto", "dummy"]
Quantization = Literal["int8", "int4"]


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: path or name, weights format, numeric type, context length."""

    model: str = "default"
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    dtype: DType = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    load_format: LoadFormat = "auto"
    seed: int = 0
    enforce_eager: bool = False  # CUDA only: never replay CUDA graphs for decode steps
    quantization: Quantization | None = None  # CPU weight-only int8/int4 (rivulet/layers/quantization.py)
    compilation_level: int = 0  # 0: eager; 1: torch.compile of the forward (rivulet/compilation/)

    def __post_init__(self) -> None:
        if self.compilation_level not in (0, 1):
            raise RivuletError(f"compilation_level must be 0 (eager) or 1 (torch.compile), not {self.compilation_level!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory it may take."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a fraction of free memory
    memory_utilization: float = 0.9  # fraction of device memory (free memory on CPU)
    num_blocks: int | None = None  # override, mostly for tests
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """The per-step budget: how many tokens and requests one flat batch may hold."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048  # the engine core's copy holds the model's value (EngineCore._setup)
    # schedule step N+1 while step N runs (rivulet/engine/core.py); None: the platform's default
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over ranks (see docs/parallelism.md); world size = tp * pp."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_sequence_parallel: bool = False  # inside TP: norms/residual on token shards, reduce-scatter + all-gather
    enable_expert_parallel: bool = False  # MoE: experts split over the TP ranks, tokens moved by all-to-all
    replicated_experts: list[int] | None = None  # EP: expert ids every rank also holds (hot experts)
    distributed_executor_backend: str | None = None  # None/"mp": worker processes here; "ray": Ray actors
    pipeline_micro_batches: int | None = None  # PP: a step's sequences in this many micro-batches (None: 1)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_json(self) -> str:
        """The whole configuration as JSON, to hand it to another process."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        d = json.loads(text)
        return cls(ModelConfig(**d["model"]), CacheConfig(**d["cache"]), SchedulerConfig(**d["scheduler"]),
                   ParallelConfig(**d["parallel"]))
