"""LLMEngine: the offline engine: a RequestProcessor around an in-process EngineCore."""

from __future__ import annotations

import itertools

from rivulet.config import EngineConfig
from rivulet.core.request import RequestStatus
from rivulet.engine.core import EngineCore
from rivulet.engine.outputs import PoolingRequestOutput, RequestOutput
from rivulet.engine.processor import PromptType, RequestProcessor
from rivulet.engine.tokenizer import eos_token_ids, load_tokenizer
from rivulet.lora_request import LoRARequest
from rivulet.models.loader import resolve_model
from rivulet.pooling_params import PoolingParams
from rivulet.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = resolve_model(config.model.model)
        self.core = EngineCore(config, self.source)  # validates the architecture before anything slow
        self.tokenizer = load_tokenizer(self.source, config.model.tokenizer)
        info = self.core.model_info()
        info.eos_token_ids |= eos_token_ids(self.source, [], self.tokenizer)
        self.processor = RequestProcessor(self.tokenizer, info, check_grammars=True, lora=config.lora)
        self._ids = itertools.count()

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> str:
        """Validate and queue a request; raises RivuletError (a ValueError) on bad input."""
        request_id = request_id or f"req-{next(self._ids)}"
        if params is None:
            params = PoolingParams() if self.processor.task == "embed" else SamplingParams()
        for req in self.processor.make_requests(request_id, prompt, params, priority,
                                                lora_request):
            self.core.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.requests)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step; returns the requests that progressed (finished ones for the last time)."""
        outputs, stopped = self.processor.process(self.core.step())
        if stopped:
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
