"""Typed configuration, built once and passed down explicitly.

This module is pure Python (no torch import) so that ``rivulet.core`` can use it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal


def json_object(name: str, value: Any) -> dict[str, Any]:
    """A dict option given as a dict (Python) or JSON text (the command line: --name-with-dashes)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RivuletError(f"{flag} is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise RivuletError(f"{name} ({flag}) must be a JSON object, not {type(value).__name__}")
    return value


def check_at_least_one(config: object, *names: str) -> None:
    """Each named field, where set (not None), is an integer >= 1; else a one-line error naming its flag."""
    for name in names:
        v = getattr(config, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise RivuletError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, got {v!r}")


class RivuletError(ValueError):
    """A user-facing error: bad input, missing files, unsupported model.

    The CLI prints its message on one line; the server maps it to HTTP 400.
    """


DType = Literal["auto", "float32", "bfloat16", "float16"]
LoadFormat = Literal["auto", "dummy"]
Quantization = Literal["int8", "int4"]
Task = Literal["generate", "embed"]


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: path or name, weights format, numeric type, context length."""

    model: str = "default"
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    dtype: DType = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    load_format: LoadFormat = "auto"
    seed: int = 0
    enforce_eager: bool = False  # every step layer by layer: no CUDA graphs (CUDA), no decode program (CPU)
    quantization: Quantization | None = None  # CPU weight-only int8/int4 (rivulet/layers/quantization.py)
    compilation_level: int = 0  # 0: eager; 1: torch.compile of the forward; 2: and Rivulet's fusion passes
    compilation_passes: str | None = None  # level 2's passes, a comma list ('' none; None: all, rivulet/compilation/)
    task: Task = "generate"  # "embed": requests are pooled into embeddings (prefill only, no KV kept)
    # embed: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} over the model's own (its
    # sentence-transformers modules, else CLS for encoders and LAST for decoders, normalized)
    pooler_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_at_least_one(self, "max_model_len")
        if self.compilation_level not in (0, 1, 2):
            raise RivuletError(f"compilation_level must be 0 (eager), 1 (torch.compile) or 2 (torch.compile and "
                               f"fusion passes), not {self.compilation_level!r}")
        if self.compilation_passes is not None and self.compilation_level != 2:
            raise RivuletError("compilation_passes (--compilation-passes) choose the fusion passes of "
                               "--compilation-level 2")
        if self.task not in ("generate", "embed"):
            raise RivuletError(f"task must be 'generate' or 'embed', not {self.task!r}")
        if self.pooler_config is not None and self.task != "embed":
            raise RivuletError("pooler_config (--pooler-config) is for --task embed")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory it may take."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a fraction of free memory
    # the share of the GPU's memory this engine may hold in all, weights and activations included (vLLM's
    # --gpu-memory-utilization); on CPU the share of free host memory, at most 2 GiB (Platform.kv_cache_budget)
    memory_utilization: float = 0.9
    num_blocks: int | None = None  # override, mostly for tests
    # the KV cache's element type: "auto" (the model's dtype) or "fp8_e5m2" (one byte: half the bytes a decode
    # step reads; vLLM's --kv-cache-dtype)
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # the KV tier below the device pool (rivulet/core/kv_tier.py): host memory, then files on disk
    kv_offload_memory: int | None = None  # bytes of host memory; None/0: no host tier
    kv_tier_path: str | None = None  # folder of the disk tier; None: no disk tier
    kv_tier_disk_bytes: int | None = None  # the disk tier's budget; None: 8 GiB, less if the disk has less free

    def __post_init__(self) -> None:
        check_at_least_one(self, "block_size")
        if self.cache_dtype not in ("auto", "fp8_e5m2"):
            hint = " (fp8_e5m2 is the one fp8 format so far)" if str(self.cache_dtype).startswith("fp8") else ""
            raise RivuletError(f"kv_cache_dtype (--kv-cache-dtype) must be auto or fp8_e5m2, got "
                               f"{self.cache_dtype!r}{hint}")
        u = self.memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise RivuletError(f"gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], "
                               f"got {self.memory_utilization!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise RivuletError(f"num_kv_blocks (--num-kv-blocks) must be an integer >= 1, got {self.num_blocks!r}")
        for name in ("kv_offload_memory", "kv_tier_disk_bytes"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise RivuletError(f"{name} (--{name.replace('_', '-')}) must be >= 0 bytes, got {v}")
        if self.kv_tier_disk_bytes is not None and self.kv_tier_path is None:
            raise RivuletError("kv_tier_disk_bytes (--kv-tier-disk-bytes) needs kv_tier_path (--kv-tier-path), "
                               "the folder of the disk tier")

    @property
    def kv_tier_enabled(self) -> bool:
        return bool(self.kv_offload_memory) or self.kv_tier_path is not None


@dataclass(frozen=True)
class SchedulerConfig:
    """The per-step budget: how many tokens and requests one flat batch may hold."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # a prompt with more tokens than this left to compute is "long": a step computes at most this many
    # prefill tokens once it holds a long prompt's chunk, so long prompts finish one after another (each
    # first token as early as it can) while short ones still batch. 0: off; None: the platform's default
    # (the engine core's copy holds the value)
    long_prefill_token_threshold: int | None = 0
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
    data_parallel_size: int = 1  # engine replicas behind one `rivulet serve` (each a tp x pp engine of its own)
    data_parallel_backend: str = "mp"  # "mp": replica engines are processes here; "ray": Ray actors
    cpus: list[int] | None = None  # the cores this engine's processes run on (a replica's share); None: all

    def __post_init__(self) -> None:
        check_at_least_one(self, "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                           "pipeline_micro_batches")
        if self.pipeline_micro_batches is not None and self.pipeline_parallel_size == 1:
            raise RivuletError("pipeline_micro_batches (--pipeline-micro-batches) is for --pipeline-parallel-size > 1")
        if self.replicated_experts and not self.enable_expert_parallel:
            raise RivuletError("replicated_experts (--replicated-experts) are for --enable-expert-parallel")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


SpeculativeMethod = Literal["ngram", "draft_model"]
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys): a proposer guesses up to
    `num_speculative_tokens` tokens per decoding request, one step of the model verifies them.
    `ngram` (rivulet/spec_decode/): prompt lookup, the continuation of the longest n-gram
    (prompt_lookup_min <= n <= prompt_lookup_max) that ends the sequence and occurred before in it.
    `draft_model` (rivulet/worker/draft_runner.py): greedy tokens of a smaller `model` with the
    target's tokenizer (optionally `quantization` int8/int4 on CPU); given a `model` and no method,
    the method is draft_model (vLLM's rule). `disable_by_batch_size`: no drafts in steps with more
    running requests than this."""

    method: SpeculativeMethod = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None  # None: prompt_lookup_max, or 5 when neither is given (vLLM's rule)
    prompt_lookup_max: int | None = None  # None: prompt_lookup_min, or 5
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: a HF folder, a .gguf file, or "default"
    quantization: Quantization | None = None  # draft_model: the draft's weight-only quantization

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise RivuletError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                               f"not {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise RivuletError("speculative_config: num_speculative_tokens must be an integer >= 1, "
                               f"not {self.num_speculative_tokens!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise RivuletError("speculative_config: method draft_model needs \"model\": the draft's path")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise RivuletError("speculative_config: prompt_lookup_min/max are for method ngram, not draft_model")
        else:
            if self.model is not None or self.quantization is not None:
                raise RivuletError("speculative_config: \"model\" and \"quantization\" are for method draft_model, "
                                   "not ngram")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo if lo is not None else hi if hi is not None else 5), (hi if hi is not None else lo or 5)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise RivuletError("speculative_config: need integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                   f"got {self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        if self.quantization not in (None, "int8", "int4"):
            raise RivuletError(f"speculative_config: quantization must be int8 or int4, not {self.quantization!r}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or b < 1):
            raise RivuletError(f"speculative_config: disable_by_batch_size must be an integer >= 1, not {b!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From `LLM(speculative_config=dict)` or `--speculative-config JSON`; unknown keys are errors."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object("speculative_config", value)
        if "method" not in value and value.get("model") is not None:
            value = value | {"method": "draft_model"}
        if value.get("method", "ngram") not in SPECULATIVE_METHODS:
            cls(method=value["method"])  # raises: the method first, before keys it would need
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise RivuletError(f"speculative_config: unknown key(s) {', '.join(unknown)} "
                               f"(known: {', '.join(sorted(names))})")
        return cls(**value)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora): `max_loras` adapters resident at once, each in a slot of
    preallocated weights (so at most that many different adapters in one batch); ranks up to `max_lora_rank`."""

    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        check_at_least_one(self, "max_loras", "max_lora_rank")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA adapters disabled

    def to_json(self) -> str:
        """The whole configuration as JSON, to hand it to another process."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        d = json.loads(text)
        spec, lora = d.get("speculative"), d.get("lora")
        return cls(ModelConfig(**d["model"]), CacheConfig(**d["cache"]), SchedulerConfig(**d["scheduler"]),
                   ParallelConfig(**d["parallel"]), SpeculativeConfig(**spec) if spec else None,
                   LoRAConfig(**lora) if lora else None)
