"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from rivulet.config import RivuletError
from rivulet.engine.args import EngineArgs
from rivulet.engine.llm_engine import LLMEngine
from rivulet.engine.processor import PromptType
from rivulet.engine.outputs import RequestOutput
from rivulet.lora_request import LoRARequest
from rivulet.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """`LLM(model, **engine_args)`: any field of `rivulet.engine.args.EngineArgs` as a keyword
    (`dtype`, `max_model_len`, `max_num_seqs`, `quantization`, `tensor_parallel_size`, ...)."""

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        self.config = EngineArgs.from_kwargs(model, kwargs).create_engine_config()
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in the order of the prompts. `lora_request`:
        one LoRA adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self.engine.add_request(None, p, sp, priority[i] if priority else 0, loras[i]))
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
        self.engine.core.drain()  # no step left running behind the caller's back
        return [done[rid] for rid in ids]
