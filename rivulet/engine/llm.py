"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from rivulet.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, RivuletError, SchedulerConfig
from rivulet.engine.llm_engine import LLMEngine
from rivulet.engine.processor import PromptType
from rivulet.engine.outputs import RequestOutput
from rivulet.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str = "default",
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        num_kv_blocks: int | None = None,
        load_format: str = "auto",
        seed: int = 0,
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_sequence_parallel: bool = False,
        enable_expert_parallel: bool = False,
        replicated_experts: list[int] | None = None,
        distributed_executor_backend: str | None = None,
        pipeline_micro_batches: int | None = None,
        async_scheduling: bool = True,
    ) -> None:
        self.config = EngineConfig(
            model=ModelConfig(model=model, tokenizer=tokenizer, dtype=dtype,  # type: ignore[arg-type]
                              max_model_len=max_model_len, load_format=load_format, seed=seed,  # type: ignore[arg-type]
                              quantization=quantization),  # type: ignore[arg-type]
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory, num_blocks=num_kv_blocks,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      async_scheduling=async_scheduling),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                                    enable_sequence_parallel=enable_sequence_parallel,
                                    enable_expert_parallel=enable_expert_parallel,
                                    replicated_experts=list(replicated_experts) if replicated_experts else None,
                                    distributed_executor_backend=distributed_executor_backend,
                                    pipeline_micro_batches=pipeline_micro_batches),
        )
        self.engine = LLMEngine(self.config)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also stop when this process exits)."""
        self.engine.core.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in the order of the prompts."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self.engine.add_request(None, p, sp, priority[i] if priority else 0))
        except Exception:
            for rid in ids:  # leave the engine as it was
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        if tok is None:
            raise RivuletError("this model has no tokenizer, so no chat template")
        prompts: list[PromptType] = []
        for conv in convs:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template)
            prompts.append({"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]
