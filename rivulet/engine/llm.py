"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from rivulet.config import RivuletError
from rivulet.engine.args import EngineArgs
from rivulet.engine.llm_engine import LLMEngine
from rivulet.engine.processor import PromptType
from rivulet.engine.outputs import PoolingRequestOutput, RequestOutput
from rivulet.lora_request import LoRARequest
from rivulet.pooling_params import PoolingParams
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
        prompts = _as_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), SamplingParams, len(prompts), "sampling params")
        loras = _per_prompt(lora_request, LoRARequest, len(prompts), "LoRA requests")
        return self._run(self._add(prompts, params, loras, priority),  # type: ignore[return-value]
                         use_tqdm and len(prompts) > 1)

    def _add(self, prompts: list[PromptType], params: Sequence[SamplingParams | PoolingParams],
             loras: Sequence[LoRARequest | None], priority: Sequence[int] | None) -> list[str]:
        """Queue every prompt, or (on bad input) none."""
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self.engine.add_request(None, p, sp, priority[i] if priority else 0, loras[i]))
        except Exception:
            for rid in ids:  # leave the engine as it was
                self.engine.abort_request(rid)
            raise
        return ids

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Embed every prompt (a model started with task="embed"), batched; `out.outputs.embedding` of each,
        in the order of the prompts. Raises RivuletError if the engine fails one."""
        prompts = _as_list(prompts)
        params = _per_prompt(pooling_params or PoolingParams(), PoolingParams, len(prompts), "pooling params")
        outs = self._run(self._add(prompts, params, [None] * len(prompts), None), use_tqdm and len(prompts) > 1)
        for out in outs:
            if out.error is not None:
                raise RivuletError(f"request {out.request_id}: {out.error}")
        return outs  # type: ignore[return-value]

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
        return self.generate(prompts, sampling_params, use_tqdm)  # type: ignore[arg-type]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        done: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processing", unit="req", disable=not use_tqdm)
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


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, a token-id list) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt(value: Any, kind: type, n: int, what: str) -> list[Any]:
    """One `kind` (or None) for every prompt, or a sequence of one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{n} prompts but {len(values)} {what}")
    return values
