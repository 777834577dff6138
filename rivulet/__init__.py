"""Rivulet: an LLM inference engine and OpenAI-compatible serving system."""

from rivulet.config import RivuletError
from rivulet.lora_request import LoRARequest
from rivulet.pooling_params import PoolingParams
from rivulet.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):  # LLM imports torch and transformers: load it on first use
    if name in ("LLM", "RequestOutput", "CompletionOutput", "PoolingRequestOutput", "EmbeddingOutput"):
        from rivulet.engine import llm, outputs

        return getattr(llm, name, None) or getattr(outputs, name)
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "PoolingParams", "RivuletError", "SamplingParams", "__version__"]
