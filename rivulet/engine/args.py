"""`EngineArgs`: every engine option, declared once.

The fields generate the flags of `rivulet generate/chat/serve/bench` (`add_cli_args`, vLLM's names:
`max_num_seqs` -> `--max-num-seqs`, a True-by-default switch `x` -> `--no-x`) and are the keyword
arguments of `LLM(...)`; `create_engine_config` turns them into the typed `EngineConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rivulet.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, RivuletError,
                            SchedulerConfig, SpeculativeConfig, json_object)


def _opt(help: str, **cli: Any) -> Any:
    return {"help": help, **cli}


@dataclass
class EngineArgs:
    model: str = field(default="default", metadata=_opt("HF folder, .gguf file, or 'default' (SmolLM2-135M-Instruct)"))
    tokenizer: str | None = field(default=None, metadata=_opt("tokenizer folder (default: the model's own)"))
    dtype: str = field(default="auto", metadata=_opt("activation and weight dtype",
                                                      choices=["auto", "float32", "bfloat16", "float16"]))
    max_model_len: int | None = field(default=None, metadata=_opt("context length (default: the model's)"))
    max_num_seqs: int = field(default=128, metadata=_opt("requests in one step at most"))
    max_num_batched_tokens: int = field(default=2048, metadata=_opt("tokens in one step at most"))
    block_size: int = field(default=16, metadata=_opt("tokens per KV cache block"))
    kv_cache_memory: int | None = field(default=None, metadata=_opt("bytes for the KV cache"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_opt(
        "share of the GPU's memory this engine may hold: weights, activations and the KV cache (on CPU: of the "
        "free host memory, the KV cache at most 2 GiB)", type=float))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "the KV cache's element type: auto (the model's dtype) or fp8_e5m2 (one byte a value: twice the tokens in "
        "the same memory, half the bytes a decode step reads; CPU, eager)", choices=["auto", "fp8_e5m2"]))
    num_kv_blocks: int | None = field(default=None, metadata=_opt("KV cache blocks (overrides --kv-cache-memory)"))
    enable_prefix_caching: bool = field(default=True, metadata=_opt("share the KV of common prompt prefixes"))
    kv_offload_memory: int | None = field(default=None, metadata=_opt(
        "bytes of host memory for cached KV blocks below the device pool (the KV tier's first level)"))
    kv_tier_path: str | None = field(default=None, metadata=_opt(
        "folder for cached KV blocks on disk (the KV tier's last level; survives restarts)"))
    kv_tier_disk_bytes: int | None = field(default=None, metadata=_opt(
        "bytes the disk tier may take (default: 8 GiB, less if the disk has less free)"))
    long_prefill_token_threshold: int | None = field(default=None, metadata=_opt(
        "a prompt longer than this is prefilled alone in chunks of this size, long prompts one after another "
        "(0: off; default: 512 on CPU, off on GPUs)"))
    async_scheduling: bool | None = field(default=None, metadata=_opt(
        "schedule step N+1 while step N runs (default: where the device computes apart from the host, i.e. "
        "not on CPU)"))
    load_format: str = field(default="auto", metadata=_opt("'dummy': random weights", choices=["auto", "dummy"]))
    seed: int = field(default=0, metadata=_opt("seed of the default random stream"))
    quantization: str | None = field(default=None, metadata=_opt(
        "CPU: int8 (Q8_0-like) or int4 (Q4_1-like) weight copies for small-batch decode", choices=["int8", "int4"],
        flags=["--quantization", "-q"]))
    enforce_eager: bool = field(default=False, metadata=_opt(
        "every step layer by layer: no CUDA-graph replays (CUDA), no decode program (CPU)"))
    compilation_level: int = field(default=0, metadata=_opt(
        "0: run the model eagerly; 1: torch.compile it (inductor; compiled code cached in ~/.cache/rivulet); "
        "2: also Rivulet's fusion passes", choices=[0, 1, 2], flags=["--compilation-level", "-O"]))
    compilation_passes: str | None = field(default=None, metadata=_opt(
        "the fusion passes of --compilation-level 2, comma-separated ('' for none; default: all: rope_kv_write)"))
    tensor_parallel_size: int = field(default=1, metadata=_opt("ranks that split each layer",
                                                                flags=["--tensor-parallel-size", "-tp"]))
    pipeline_parallel_size: int = field(default=1, metadata=_opt("stages that split the layers",
                                                                  flags=["--pipeline-parallel-size", "-pp"]))
    data_parallel_size: int = field(default=1, metadata=_opt(
        "rivulet serve: engine replicas behind one API server, each on its share of the cores",
        flags=["--data-parallel-size", "-dp"]))
    data_parallel_backend: str = field(default="mp", metadata=_opt(
        "rivulet serve: mp (replica engines are processes on this machine) or ray (Ray actors placed over the "
        "cluster that RAY_ADDRESS names, or a local one)", choices=["mp", "ray"]))
    enable_sequence_parallel: bool = field(default=False, metadata=_opt(
        "with TP: norms and residuals on token shards (reduce-scatter + all-gather)"))
    enable_expert_parallel: bool = field(default=False, metadata=_opt(
        "MoE: split the experts over the TP ranks, tokens moved by all-to-all"))
    replicated_experts: list[int] | None = field(default=None, metadata=_opt(
        "with expert parallelism: expert ids every rank also holds (hot experts)", nargs="+", type=int))
    distributed_executor_backend: str | None = field(default=None, metadata=_opt(
        "worker processes on this machine (mp, default) or Ray actors (ray)", choices=["mp", "ray"]))
    pipeline_micro_batches: int | None = field(default=None, metadata=_opt(
        "with PP: micro-batches per step in flight through the stages (default: 1)"))
    enable_lora: bool = field(default=False, metadata=_opt(
        "serve LoRA adapters (PEFT folders) beside the base model: --lora-modules, or a request's LoRARequest"))
    max_loras: int = field(default=1, metadata=_opt(
        "with --enable-lora: adapters resident at once (and so in one batch at most)"))
    max_lora_rank: int = field(default=16, metadata=_opt("with --enable-lora: the highest adapter rank accepted"))
    task: str = field(default="generate", metadata=_opt(
        "generate: text; embed: pooled embeddings (/v1/embeddings, LLM.embed), prefill only", choices=["generate", "embed"]))
    pooler_config: dict | str | None = field(default=None, metadata=_opt(
        "with --task embed, as JSON: '{\"pooling_type\": \"MEAN\", \"normalize\": true}' (LAST, MEAN or CLS; "
        "default: the model's sentence-transformers modules, else CLS for encoders and LAST for decoders)", type=str))
    speculative_config: dict | str | None = field(default=None, metadata=_opt(
        "speculative decoding as JSON (vLLM's keys), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
        "\"prompt_lookup_max\": 4}' or '{\"model\": DRAFT_PATH, \"num_speculative_tokens\": 4}'", type=str))

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            flags = meta.pop("flags", ["--" + f.name.replace("_", "-")])
            if f.type == "bool | None":  # --x / --no-x, unset: the engine decides
                name = f.name.replace("_", "-")
                p.add_argument("--" + name, dest=f.name, action="store_true", default=None, **meta)
                p.add_argument("--no-" + name, dest=f.name, action="store_false", default=None,
                               help=f"the opposite of --{name}")
                continue
            if f.type in ("bool", bool):
                if f.default:
                    p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false", **meta)
                else:
                    p.add_argument(*flags, dest=f.name, action="store_true", **meta)
                continue
            kind = meta.pop("type", None) or (int if "int" in str(f.type) and "list" not in str(f.type) else None)
            p.add_argument(*flags, dest=f.name, default=f.default, **({"type": kind} if kind else {}), **meta)

    @classmethod
    def from_cli_args(cls, a: argparse.Namespace) -> EngineArgs:
        return cls(**{k: v for k, v in vars(a).items() if k in cls.names()})

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict[str, Any]) -> EngineArgs:
        unknown = sorted(set(kwargs) - cls.names())
        if unknown:
            raise RivuletError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,  # type: ignore[arg-type]
                              max_model_len=self.max_model_len, load_format=self.load_format,  # type: ignore[arg-type]
                              seed=self.seed, enforce_eager=self.enforce_eager,
                              compilation_level=self.compilation_level,
                              compilation_passes=self.compilation_passes,
                              quantization=self.quantization, task=self.task,  # type: ignore[arg-type]
                              pooler_config=None if self.pooler_config is None else json_object(
                                  "pooler_config", self.pooler_config)),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                              memory_utilization=self.gpu_memory_utilization, cache_dtype=self.kv_cache_dtype,
                              num_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
                              kv_offload_memory=self.kv_offload_memory, kv_tier_path=self.kv_tier_path,
                              kv_tier_disk_bytes=self.kv_tier_disk_bytes),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      async_scheduling=self.async_scheduling),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
                enable_sequence_parallel=self.enable_sequence_parallel,
                enable_expert_parallel=self.enable_expert_parallel,
                replicated_experts=list(self.replicated_experts) if self.replicated_experts else None,
                distributed_executor_backend=self.distributed_executor_backend,
                pipeline_micro_batches=self.pipeline_micro_batches, data_parallel_size=self.data_parallel_size,
                data_parallel_backend=self.data_parallel_backend),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            lora=LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank) if self.enable_lora else None,
        )

