"""The engine interface the HTTP handlers use: what ``AsyncLLM`` offers (and test fakes imitate)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from rivulet.engine.async_llm import EngineDeadError
from rivulet.engine.outputs import ModelInfo, RequestOutput
from rivulet.lora_request import LoRARequest
from rivulet.sampling_params import SamplingParams

__all__ = ["EngineClient", "EngineDeadError", "PromptProcessor"]


class PromptProcessor(Protocol):
    """The part of ``RequestProcessor`` the server uses: tokenization with the engine's rules."""

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]: ...


class EngineClient(Protocol):
    """An engine reached asynchronously; ``generate`` yields cumulative ``RequestOutput`` snapshots."""

    tokenizer: Any  # a Hugging Face tokenizer, or None for weights-only models
    model_info: ModelInfo
    processor: PromptProcessor

    def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    async def get_stats(self) -> dict[str, Any]: ...

    async def shutdown(self) -> None: ...
